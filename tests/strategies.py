"""Hypothesis strategies shared by the test modules."""

from hypothesis import strategies as st

from ref.gemma4.config import VisionConfig


@st.composite
def vision_configs(draw, max_layers=4):
    """Tiny Gemma 4 vision configs: GQA on/off, head_dim up to 36, clipping, standardize."""
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([8, 12, 16, 24, 36]))
    return VisionConfig(
        hidden_size=draw(st.sampled_from([16, 24, 32, 48])),
        intermediate_size=draw(st.sampled_from([32, 48, 64])),
        num_hidden_layers=draw(st.integers(1, max_layers)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5])),
        rope_theta=draw(st.sampled_from([100.0, 37.0])),
        patch_size=draw(st.sampled_from([1, 2])),
        position_embedding_size=draw(st.sampled_from([64, 96])),
        use_clipped_linears=draw(st.booleans()),
        standardize=draw(st.booleans()),
        text_hidden_size=draw(st.sampled_from([None, 20])),
    )


def grid_side(k=3, max_blocks=8):
    """A grid side: a positive multiple of the pooling kernel."""
    return st.integers(1, max_blocks).map(lambda n: n * k)


@st.composite
def grids(draw, max_items=5, k=3):
    """1–5 items mixing squares, thin strips (3×60, 60×3) and random rectangles."""
    item = st.one_of(
        st.tuples(grid_side(k), grid_side(k)),
        grid_side(k).map(lambda s: (s, s)),
        st.sampled_from([(k, 20 * k), (20 * k, k), (k, k)]),
    )
    return draw(st.lists(item, min_size=1, max_size=max_items))
