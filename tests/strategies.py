"""Hypothesis strategies shared by the test modules."""

from hypothesis import strategies as st

from ref.gemma4.audio_config import AudioConfig
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


@st.composite
def audio_configs(draw, max_layers=2):
    """Tiny Gemma 4 audio configs: the released chunking (12 queries, 12 past, none ahead) or a
    drawn one (future keys too), soft caps that bite, residual clamps on or off, clipping."""
    hidden = draw(st.sampled_from([16, 24, 32]))
    chunking = draw(
        st.one_of(
            st.just((12, 13, 0)),
            st.tuples(st.integers(1, 8), st.integers(2, 10), st.integers(0, 3)),
        )
    )
    return AudioConfig(
        hidden_size=hidden,
        num_hidden_layers=draw(st.integers(1, max_layers)),
        num_attention_heads=draw(st.sampled_from([1, 2, 4])),
        # not 2: a LayerNorm over two channels is ill-conditioned (float32 noise of 4.5e-5 in
        # ours and transformers' alike, measured against float64)
        subsampling_conv_channels=(128, draw(st.sampled_from([4, 8, 32]))),
        conv_kernel_size=draw(st.sampled_from([3, 5])),
        residual_weight=draw(st.sampled_from([0.5, 0.75])),
        attention_chunk_size=chunking[0],
        attention_context_left=chunking[1],
        attention_context_right=chunking[2],
        attention_logit_cap=draw(st.sampled_from([50.0, 3.0])),
        use_clipped_linears=draw(st.booleans()),
        rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5])),
        gradient_clipping=draw(st.sampled_from([1e10, 2.0])),
        output_proj_dims=draw(st.sampled_from([12, 24])),
        text_hidden_size=20,
    )


def clip_samples(max_samples=12_000):
    """A clip length in samples: at least one valid frame (161), rarely a multiple of the hop."""
    return st.one_of(
        st.integers(161, max_samples),
        st.sampled_from([161, 320, 321, 480, 481, 1_600, 6_400]),
    )


# Gemma 4 replies (codegen.run.reply, codegen.run.stream)
QUOTE = '<|"|>'  # the released template's string marks
# text a field may hold: words, whitespace, punctuation and the marks' own characters
PIECES = [*"ab <>|{}:,.\n\"'\\é", "call", "thought", "<|"]
TEXT = st.lists(st.sampled_from(PIECES), max_size=8).map("".join)
KEYS = st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True)
SCALARS = st.one_of(
    TEXT, st.booleans(), st.integers(-(10**12), 10**12), st.floats(allow_nan=False,
                                                                   allow_infinity=False),
)  # fmt: skip
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=6,
)  # fmt: skip


def written(value):
    """A Gemma 4 tool call's argument as the released template's format_argument(escape_keys=
    False) writes it (strings between quote marks, keys bare and sorted)."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{written(value[k])}" for k in sorted(value)) + "}"
    if isinstance(value, list):
        return "[" + ",".join(map(written, value)) + "]"
    return str(value)


@st.composite
def replies(draw):
    """(the reply's text, its thought, answer and calls): a thought or none, an answer, 0–2
    calls, and the end of the turn (or the call's stop id, or nothing)."""
    thought = draw(st.none() | TEXT)
    answer = draw(TEXT)
    calls = draw(st.lists(st.tuples(KEYS, st.dictionaries(KEYS, VALUES, max_size=3)),
                          max_size=2))  # fmt: skip
    text = "" if thought is None else f"<|channel>thought\n{thought}<channel|>"
    text += answer + "".join(f"<|tool_call>call:{n}{written(a)}<tool_call|>" for n, a in calls)
    text += draw(st.sampled_from(["", "<turn|>", "<|tool_response>"]))
    return text, thought, answer, [{"name": n, "arguments": a} for n, a in calls]
