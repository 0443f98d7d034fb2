"""transformers' Gemma4ForConditionalGeneration as the text oracle: tiny configs, every tensor
randomized, and the same model as a checkpoint tree for `ref`."""

import numpy as np
import torch
from transformers import Gemma4Config, Gemma4ForConditionalGeneration

IMAGE, BOI, EOI = 4, 5, 6
FIRST_TEXT = 7  # prompt tokens are drawn from [FIRST_TEXT, vocab)

VISION = {
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "patch_size": 2,
    "position_embedding_size": 16,
    "pooling_kernel_size": 3,
    "use_clipped_linears": True,
    "standardize": True,
    "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
}


def text_config(*, moe, layer_types, shared=0, k_eq_v=False, ple=16, softcap=30.0, window=6):
    """Kwargs of a tiny Gemma4TextConfig in the shape of transformers' own test config."""
    return dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=16,
        num_global_key_value_heads=1 if k_eq_v else None,
        attention_k_eq_v=k_eq_v,
        layer_types=list(layer_types),
        num_kv_shared_layers=shared,
        sliding_window=window,
        vocab_size_per_layer_input=96,
        hidden_size_per_layer_input=ple,
        enable_moe_block=moe,
        num_experts=4 if moe else None,
        top_k_experts=2 if moe else None,
        moe_intermediate_size=12 if moe else None,
        use_bidirectional_attention="vision",
        final_logit_softcapping=softcap,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.5,
                "rope_theta": 1_000_000.0,
            },
        },
    )


def randomize_(model, seed):
    """Randomize every parameter and buffer in place, away from neutral values.

    Linear weights ~ N(0, 1/in); the token embedding ~ N(0, 1) so logits are well separated
    (greedy choices far from ties); norm weights around 1, q/k norms ×0.25 (unscaled attention
    stays smooth); layer scalars, router scales and clip bounds random.
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


def hf_model(text, seed):
    """A randomized float32 eager Gemma4ForConditionalGeneration with a tiny vision tower."""
    config = Gemma4Config(
        text_config=text,
        vision_config=dict(VISION),
        image_token_id=IMAGE,
        boi_token_id=BOI,
        eoi_token_id=EOI,
    )
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomize_(Gemma4ForConditionalGeneration(config).eval(), seed)


def tree_of(state_dict):
    """Nested numpy tree (keys split on '.') of a state dict: the checkpoint's own names."""
    tree = {}
    for name, t in state_dict.items():
        node = tree
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = t.detach().numpy().copy()
    return tree


def patches_for(grids, rng, patch_dim):
    """Random pixels in [0, 1] per image: list of [h·w, patch_dim] float32."""
    return [rng.random((h * w, patch_dim), dtype=np.float32) for h, w in grids]


def hf_pixels(patches, grids):
    """HF's padded image batch: pixel_values [N, L, P], image_position_ids [N, L, 2]."""
    length = max(h * w for h, w in grids)
    values = np.zeros((len(grids), length, patches[0].shape[1]), np.float32)
    pos = np.full((len(grids), length, 2), -1, np.int64)
    for i, (p, (h, w)) in enumerate(zip(patches, grids, strict=True)):
        values[i, : h * w] = p
        xs, ys = np.meshgrid(np.arange(w), np.arange(h), indexing="xy")
        pos[i, : h * w] = np.stack([xs.ravel(), ys.ravel()], -1)
    return torch.from_numpy(values), torch.from_numpy(pos)


def prompt(rng, length, images, vocab):
    """Token ids [length + runs]: text with each image's run `BOI IMAGE×n EOI` at random places.

    images: soft-token counts per image, in order.
    """
    text = list(rng.integers(FIRST_TEXT, vocab, size=length))
    cuts = sorted(rng.integers(0, length + 1, size=len(images)))
    ids, start = [], 0
    for cut, n in zip(cuts, images, strict=True):
        ids += text[start:cut] + [BOI] + [IMAGE] * n + [EOI]
        start = cut
    return np.array(ids + text[start:], np.int64)


def hf_generate(model, ids, patches, grids, max_new_tokens):
    """Greedy generation for one prompt: (new tokens [max_new_tokens], per-step logits)."""
    kwargs = {}
    if grids:
        kwargs["pixel_values"], kwargs["image_position_ids"] = hf_pixels(patches, grids)
    input_ids = torch.from_numpy(ids)[None]
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=(input_ids == IMAGE).long(),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    tokens = out.sequences[0, len(ids) :].numpy()
    return tokens, np.stack([x[0].numpy() for x in out.logits])
