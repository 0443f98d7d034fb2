"""weights against transformers: what `save_pretrained` writes loads bit-exactly as
`state_dict()` (every persistent buffer included), and what `save_checkpoint` writes
`from_pretrained` loads without missing or unexpected keys."""

import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import weights

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
    Gemma4VisionConfig,
    Gemma4VisionModel,
)

from ref.gemma4.params import dotted  # noqa: E402
from tests.hf_vision import hf_vision_config, randomize_  # noqa: E402
from tests.strategies import vision_configs  # noqa: E402
from tests.util import examples  # noqa: E402


def torch_bits(t) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def np_bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def assert_matches_state_dict(params: dict, state: dict) -> None:
    flat = dotted(params)
    assert set(flat) == set(state)
    for name, t in state.items():
        assert flat[name].shape == tuple(t.shape), name
        assert (
            weights.dtype_code(flat[name].dtype)
            == {
                torch.float32: "F32",
                torch.bfloat16: "BF16",
            }[t.dtype]
        )
        assert np_bits(flat[name]) == torch_bits(t), name


@settings(max_examples=examples(6))
@given(
    config=vision_configs(max_layers=2).map(hf_vision_config),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    shard=st.sampled_from([None, "1KB"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_save_pretrained_vision_model_loads_bit_exactly(config, dtype, shard, seed):
    model = randomize_(Gemma4VisionModel(config), seed).to(dtype)
    state = model.state_dict()
    with tempfile.TemporaryDirectory() as tmp:
        kwargs = {} if shard is None else {"max_shard_size": shard}
        model.save_pretrained(tmp, **kwargs)
        cfg, params = weights.load_checkpoint(tmp)
        assert cfg["model_type"] == "gemma4_vision" and cfg["hidden_size"] == config.hidden_size
        assert_matches_state_dict(params, state)
        ckpt = weights.open_checkpoint(tmp)
        ckpt.require({k: tuple(v.shape) for k, v in state.items()})
        assert (len(ckpt.shards) > 1) == (shard is not None)
    layer = params["encoder"]["layers"]["0"]
    assert "weight" in layer["self_attn"]["q_proj"]["linear"]
    if config.use_clipped_linears:
        assert {"input_min", "input_max", "output_min", "output_max"} <= set(
            layer["mlp"]["down_proj"]
        )
    assert ("std_bias" in params and "std_scale" in params) == config.standardize


def test_save_pretrained_full_model_loads_bit_exactly():
    vision = Gemma4VisionConfig(
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        position_embedding_size=12,
        use_clipped_linears=True,
        standardize=True,
    )
    text = Gemma4TextConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size_per_layer_input=64,
        hidden_size_per_layer_input=4,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    model = randomize_(
        Gemma4ForConditionalGeneration(
            Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
        ),
        seed=1,
    )
    # lm_head is tied to the token embedding and not saved
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, max_shard_size="20KB")
        ckpt = weights.open_checkpoint(tmp)
        assert len(ckpt.shards) > 1
        cfg, params = weights.load_checkpoint(tmp)
        assert_matches_state_dict(params, state)
        assert cfg["vision_config"]["hidden_size"] == 16
        tower = ckpt.tree("model.vision_tower.")
        q = params["model"]["vision_tower"]["encoder"]["layers"]["0"]["self_attn"]["q_proj"]
        assert np_bits(q["linear"]["weight"]) == torch_bits(
            state["model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight"]
        )
        standalone = Gemma4VisionModel(vision).state_dict()
        assert set(dotted(tower)) == set(standalone)
        assert "embedding_projection" in params["model"]["embed_vision"]


@pytest.mark.parametrize("max_shard_bytes", [None, 2048])
def test_transformers_loads_what_save_checkpoint_writes(tmp_path, max_shard_bytes):
    config = Gemma4VisionConfig(
        hidden_size=12,
        intermediate_size=20,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=4,
        position_embedding_size=8,
        use_clipped_linears=True,
        standardize=True,
    )
    rng = np.random.default_rng(0)
    template = Gemma4VisionModel(config).state_dict()
    tensors = {
        k: rng.standard_normal(tuple(v.shape)).astype(np.float32) for k, v in template.items()
    }
    weights.save_checkpoint(
        tmp_path / "m", config.to_dict(), tensors, max_shard_bytes=max_shard_bytes
    )
    assert (tmp_path / "m" / "model.safetensors.index.json").exists() == bool(max_shard_bytes)
    model, info = Gemma4VisionModel.from_pretrained(tmp_path / "m", output_loading_info=True)
    assert not any(info.values()), info
    for name, t in model.state_dict().items():
        assert torch_bits(t) == np_bits(tensors[name]), name
