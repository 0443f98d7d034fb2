"""transformers' Gemma4VisionModel as the oracle: built from a config, every tensor randomized."""

import dataclasses

import numpy as np
import torch
from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4VisionModel

from ref.gemma4.params import nested


def hf_vision_config(cfg):
    """A transformers Gemma4VisionConfig from our VisionConfig (eager attention)."""
    fields = dataclasses.asdict(cfg)
    theta = fields.pop("rope_theta")
    fields.pop("text_hidden_size")
    hf = Gemma4VisionConfig(**fields, rope_parameters={"rope_type": "axial", "rope_theta": theta})
    hf._attn_implementation = "eager"
    return hf


def randomize_(model, seed):
    """Randomize every parameter and buffer of a Gemma 4 model (or part) in place, away from
    neutral values.

    Linear weights ~ N(0, 1/in); the token embedding ~ N(0, 1) so logits are well separated
    (greedy choices far from ties); norm weights around 1, q/k norms ×0.25 (unscaled attention
    stays smooth); layer scalars, router scales, the position table, clip bounds (tight enough
    to clip) and std_bias/std_scale random.
    """
    g = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=g, dtype=torch.float64)

    def rand(shape):
        return torch.rand(shape, generator=g, dtype=torch.float64)

    with torch.no_grad():
        for name, t in list(model.state_dict().items()):
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("embed_tokens.weight"):
                new = randn(t.shape)
            elif leaf == "weight" and t.ndim == 2:
                new = randn(t.shape) / np.sqrt(t.shape[1])
            elif leaf in ("gate_up_proj", "down_proj") and t.ndim == 3:
                new = randn(t.shape) / np.sqrt(t.shape[2])
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                new = 0.25 * (1 + 0.2 * randn(t.shape))
            elif leaf in ("weight", "scale", "per_expert_scale", "std_scale"):
                new = 1 + 0.2 * randn(t.shape)
            elif leaf == "layer_scalar":
                new = 0.5 + rand(t.shape)
            elif leaf == "position_embedding_table":
                new = 0.5 * randn(t.shape)
            elif leaf in ("input_min", "output_min"):
                new = -(0.5 + 2 * rand(()))
            elif leaf in ("input_max", "output_max"):
                new = 0.5 + 2 * rand(())
            elif leaf == "std_bias":
                new = randn(t.shape)
            else:
                raise AssertionError(f"randomize_: no rule for {name}")
            t.copy_(new.to(t.dtype))
    return model


def hf_vision_model(cfg, seed):
    """A randomized float32 Gemma4VisionModel in eval mode."""
    torch.manual_seed(seed)
    return randomize_(Gemma4VisionModel(hf_vision_config(cfg)).eval(), seed)


def hf_full_model(cfg, seed, text_hidden=20):
    """A tiny randomized Gemma4ForConditionalGeneration around the given vision config (its text
    model is never run: a per-layer-input table of the vocabulary's 64 rows, not transformers'
    default 262,144, which cost 0.6 s of every build)."""
    text = {
        "hidden_size": text_hidden,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "vocab_size": 64,
        "vocab_size_per_layer_input": 64,
        "layer_types": ["full_attention"],
    }
    config = Gemma4Config(text_config=text, vision_config=hf_vision_config(cfg).to_dict())
    config.vision_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config).eval()
    randomize_(model.model.vision_tower, seed)
    randomize_(model.model.embed_vision, seed + 1)
    return model


def tree_of(state_dict, prefix=""):
    """Nested numpy tree (keys split on '.') of the tensors under `prefix`."""
    names = [n for n in state_dict if n.startswith(prefix)]
    return nested(names, [state_dict[n].detach().numpy().copy() for n in names], prefix)


def patches_for(grids, rng, patch_dim):
    """Random pixels in [0, 1] per image: list of [h·w, patch_dim] float32."""
    return [rng.random((h * w, patch_dim), dtype=np.float32) for h, w in grids]


def hf_padded_inputs(patches, grids, pad_tokens=0, k=3):
    """HF's padded batch: every item padded to the longest (+ pad_tokens·k²) with (−1, −1).

    → pixel_values [B, L, P] float32, pixel_position_ids [B, L, 2] int64.
    """
    length = max(h * w for h, w in grids) + pad_tokens * k * k
    pdim = patches[0].shape[1]
    values = np.zeros((len(grids), length, pdim), np.float32)
    pos = np.full((len(grids), length, 2), -1, np.int64)
    for i, (p, (h, w)) in enumerate(zip(patches, grids, strict=True)):
        values[i, : h * w] = p
        xs, ys = np.meshgrid(np.arange(w), np.arange(h), indexing="xy")
        pos[i, : h * w] = np.stack([xs.ravel(), ys.ravel()], -1)
    return torch.from_numpy(values), torch.from_numpy(pos)


def hf_encode(model, patches, grids, pad_tokens=0):
    """HF's last_hidden_state split per item, plus its per-layer hidden states."""
    values, pos = hf_padded_inputs(patches, grids, pad_tokens, model.config.pooling_kernel_size)
    with torch.no_grad():
        out = model(pixel_values=values, pixel_position_ids=pos, output_hidden_states=True)
    flat = out.last_hidden_state.numpy()
    k2 = model.config.pooling_kernel_size**2
    sizes = np.cumsum([0] + [h * w // k2 for h, w in grids])
    return [flat[a:b] for a, b in zip(sizes[:-1], sizes[1:], strict=True)], out.hidden_states
