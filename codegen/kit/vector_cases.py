"""The problem behind each golden-vector op: random float64 inputs with their layouts and the
`ref` function that answers them (`Case`), built from resolved options
(`codegen.kit.vector_options`). `codegen.kit.vectors` rounds, runs and writes them."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from codegen.kit.vector_options import (
    attention_positions,
    attention_sizes,
    audio_packing,
    blocking_config,
    grids,
    moe_mode,
    moe_routing,
    moe_sizes,
)
from ref import cache
from ref.attention import blocked, reference
from ref.gemma4 import moe
from ref.gemma4.audio_attention import chunked_attention
from ref.gemma4.packing import pack
from ref.gemma4.vision import packed_attention, pool
from ref.rope import axial_rope


@dataclasses.dataclass(frozen=True)
class Case:
    """One op's vectors before rounding: float inputs (float64 values) and int inputs, each
    with its layout; `run(arrays)` is ref on jnp arrays; `scalars` are float options that enter
    the arithmetic (rounded with the inputs); `extra` goes into vectors.json as is."""

    floats: dict
    ints: dict
    layouts: dict
    out_layout: str
    reference: str
    run: object
    scalars: dict
    extra: dict


def _attention_case(mode, options, rng):
    b, h, hkv, s, t, d = attention_sizes(options)
    config = blocking_config(mode, options)
    plan = None
    if config is not None:
        plan = config.plan(b, h, hkv, s, t, num_devices=jax.local_device_count())
    q_pos, kv_pos, q_group, kv_group = attention_positions(options)
    fold = config is not None and config.batch_fold
    cache_shape = (1, b * hkv, t, d) if fold else (b, hkv, t, d)
    cache_layout = "[1, B*Hkv, T, D] (batch_fold: row b*Hkv + j)" if fold else "[B, Hkv, T, D]"
    floats = {
        "q": rng.standard_normal((b, h, s, d)),
        "k": rng.standard_normal((b, hkv, t, d)).reshape(cache_shape),
        "v": rng.standard_normal((b, hkv, t, d)).reshape(cache_shape),
    }
    ints = {"q_pos": q_pos, "kv_pos": kv_pos}
    layouts = {
        "q": "[B, H, S, D]",
        "k": cache_layout,
        "v": cache_layout,
        "q_pos": "[B, S] (-1 = padding)",
        "kv_pos": "[B, T] (-1 = empty slot)",
    }
    if q_group is not None:
        ints |= {"q_group": q_group, "kv_group": kv_group}
        layouts |= {"q_group": "[B, S] (vision run id, -1 = text)", "kv_group": "[B, T]"}
    window = options["sliding_window"]

    def run(a, scalars):
        kwargs = dict(
            sliding_window=window,
            q_group=a.get("q_group"),
            kv_group=a.get("kv_group"),
            scale=scalars["scale"],
            softcap=scalars["softcap"],
        )
        args = (a["q"], a["k"], a["v"], a["q_pos"], a["kv_pos"])
        if config is None:
            return reference(*args, **kwargs)
        return blocked(*args, config=config, **kwargs)

    groups = "q_group=q_group, kv_group=kv_group, " if q_group is not None else ""
    call = "reference" if config is None else "blocked"
    how = "" if config is None else f", config={config!r}"
    return Case(
        floats=floats,
        ints=ints,
        layouts=layouts,
        out_layout="[B, H, S, D]",
        reference=f"ref.attention.{call}(q, k, v, q_pos, kv_pos, {groups}"
        f"sliding_window={window}, scale=scale, softcap=softcap{how})",
        run=run,
        scalars={"scale": options["scale"], "softcap": options["softcap"]},
        extra={"blocks": None if plan is None else _plain(dataclasses.asdict(plan))},
    )


def _plain(x):
    """Tuples → lists, recursively (for JSON)."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return x


def _cache_update_case(options, rng):
    b, hkv, s, t, d = (options[n] for n in ("batch", "kv_heads", "seq", "ctx", "head_dim"))
    for name in ("batch", "kv_heads", "seq", "ctx", "head_dim"):
        if options[name] < 1:
            raise ValueError(f"option {name}={options[name]}: expected an integer >= 1")
    if s > t:
        raise ValueError(f"seq={s} distinct slots do not fit the cache of ctx={t} slots")
    if options["empty"] > s:
        raise ValueError(f"empty={options['empty']} is more than the seq={s} slots per row")
    slots = np.stack([rng.permutation(t)[:s] for _ in range(b)])
    for row in slots:
        row[rng.permutation(s)[: options["empty"]]] = -1
    floats = {
        "cache_k": rng.standard_normal((b, hkv, t, d)),
        "cache_v": rng.standard_normal((b, hkv, t, d)),
        "k_new": rng.standard_normal((b, hkv, s, d)),
        "v_new": rng.standard_normal((b, hkv, s, d)),
    }

    def run(a, _):
        new = cache.update(a["cache_k"], a["cache_v"], a["k_new"], a["v_new"], a["slots"])
        return jnp.stack(new)

    return Case(
        floats=floats,
        ints={"slots": slots.astype(np.int32)},
        layouts={
            "cache_k": "[B, Hkv, T, D]",
            "cache_v": "[B, Hkv, T, D]",
            "k_new": "[B, Hkv, S, D]",
            "v_new": "[B, Hkv, S, D]",
            "slots": "[B, S] (-1 = write nothing; distinct otherwise)",
        },
        out_layout="[2, B, Hkv, T, D] (the updated cache_k, then cache_v)",
        reference="jnp.stack(ref.cache.update(cache_k, cache_v, k_new, v_new, slots))",
        run=run,
        scalars={},
        extra={},
    )


def _heads(options):
    h, hkv, d = options["heads"], options["kv_heads"], options["head_dim"]
    if min(h, hkv, d) < 1 or h % hkv:
        raise ValueError(
            f"heads={h}, kv_heads={hkv}, head_dim={d}: expected sizes >= 1 with heads a "
            "multiple of kv_heads"
        )
    return h, hkv, d


def _vision_attention_case(options, rng):
    h, hkv, d = _heads(options)
    packing = pack(grids(options["grids"]), budget=options["budget"])
    n = len(packing.segment_ids)
    cu = packing.cu_seqlens_static if options["varlen"] else None

    def run(a, _):
        return packed_attention(a["q"], a["k"], a["v"], a["segment_ids"], cu)

    return Case(
        floats={
            "q": rng.standard_normal((n, h, d)),
            "k": rng.standard_normal((n, hkv, d)),
            "v": rng.standard_normal((n, hkv, d)),
        },
        ints={"segment_ids": packing.segment_ids, "cu_seqlens": packing.cu_seqlens},
        layouts={
            "q": "[N, H, D] (packed patches)",
            "k": "[N, Hkv, D]",
            "v": "[N, Hkv, D]",
            "segment_ids": "[N] item index, -1 = filler (attends to nothing, output 0)",
            "cu_seqlens": "[items + 1] patch offsets of the items (filler after the last)",
        },
        out_layout="[N, H, D]",
        reference="ref.gemma4.vision.packed_attention(q, k, v, segment_ids"
        + (", cu_seqlens=tuple(cu_seqlens))" if cu else ")"),
        run=run,
        scalars={},
        extra={"grids": [list(g) for g in packing.grids]},
    )


def _audio_attention_case(options, rng):
    config, packing = audio_packing(options)
    m, h, d = len(packing.segment_ids), config.num_attention_heads, config.head_dim
    past, future = config.max_past, config.attention_context_right
    invalid = config.attention_invalid_logits_value
    index = {k: packing.arrays[k] for k in ("chunk_queries", "chunk_keys", "token_slots")}

    def run(a, scalars):
        args = (a[k] for k in ("q", "k", "v", "rel_k", *index))
        kwargs = dict(past=past, future=future, cap=scalars["cap"], invalid=invalid)
        return chunked_attention(*args, **kwargs)

    chunking = f"past={past}, future={future}, cap=cap, invalid={invalid}"
    return Case(
        floats={
            "q": rng.standard_normal((m, h, d)),
            "k": rng.standard_normal((m, h, d)),
            "v": rng.standard_normal((m, h, d)),
            "rel_k": rng.standard_normal((config.relative_positions, h, d)),
        },
        ints={**index, "segment_ids": packing.segment_ids, "cu_tokens": packing.cu_tokens},
        layouts={
            "q": "[M, H, D] packed soft tokens, q_proj scaled (head_dim^-0.5 / ln 2 * "
            "softplus(per_dim_scale))",
            "k": "[M, H, D], k_proj scaled (ln(1 + e) / ln 2)",
            "v": "[M, H, D]",
            "rel_k": "[npos, H, D] relative_k_proj of the sinusoid table: row j is relative "
            "position npos - 1 - j; query i of a chunk reads row P - d for a key d before it",
            "chunk_queries": "[B, C] each chunk's queries (M: outside the clip, a zero row)",
            "chunk_keys": "[B, C + P + F] each chunk's keys s - P .. s + C + F - 1 of its clip "
            "(M: outside the clip, a zero row, masked)",
            "token_slots": "[M] row of the chunks' [B*C] outputs holding each token's output",
            "segment_ids": "[M] clip index, -1 = filler (the dense reference's input)",
            "cu_tokens": "[clips + 1] soft-token offsets of the clips (filler after the last)",
        },
        out_layout="[M, H, D]; filler tokens (segment_ids -1) hold chunk row 0's output "
        "(token_slots 0): compare the rows with segment_ids >= 0",
        reference="ref.gemma4.audio_attention.chunked_attention(q, k, v, rel_k, chunk_queries, "
        f"chunk_keys, token_slots, {chunking})",
        run=run,
        scalars={"cap": options["cap"]},
        extra={
            "frame_counts": list(packing.frame_counts),
            "token_counts": list(packing.token_counts),
            "dense_reference": "ref.gemma4.audio_reference.reference(q, k, v, rel_k, "
            f"segment_ids, {chunking})",
            "order": "scores q.k + rel_shift(q.rel_k), then cap*tanh(s/cap), then the mask "
            f"({invalid} where hidden), then softmax in float32 at least",
        },
    )


def _pool_case(options, rng):
    if options["hidden"] < 1:
        raise ValueError(f"option hidden={options['hidden']}: expected an integer >= 1")
    packing = pack(grids(options["grids"]), budget=options["budget"])
    scale = options["scale"]
    scale = math.sqrt(options["hidden"]) if scale is None else scale

    def run(a, scalars):
        return pool(a["x"], a["pool_index"], scalars["scale"])

    return Case(
        floats={"x": rng.standard_normal((len(packing.segment_ids), options["hidden"]))},
        ints={"pool_index": packing.pool_index},
        layouts={
            "x": "[N, D] (packed patches)",
            "pool_index": "[M, 9] indices into x of each soft token's 3x3 block",
        },
        out_layout="[M, D], float32 for float16/bfloat16 x (ref pools in at least float32)",
        reference="ref.gemma4.vision.pool(x, pool_index, scale)",
        run=run,
        scalars={"scale": scale},
        extra={"grids": [list(g) for g in packing.grids]},
    )


def _rope2d_case(options, rng):
    h, _, d = _heads({**options, "kv_heads": 1})
    positions = pack(grids(options["grids"]), pooling_kernel_size=1).positions

    def run(a, scalars):
        return axial_rope(a["x"], a["positions"], scalars["theta"])

    return Case(
        floats={"x": rng.standard_normal((len(positions), h, d))},
        ints={"positions": positions},
        layouts={"x": "[N, H, D]", "positions": "[N, 2] (x = column, y = row), per item"},
        out_layout="[N, H, D]",
        reference="ref.rope.axial_rope(x, positions, theta)",
        run=run,
        scalars={"theta": options["theta"]},
        extra={"note": "ref computes angles, cos and sin in float32 for every input dtype"},
    )


def _moe_case(mode, options, rng):
    t, d, e, i, _ = moe_sizes(options)
    how = moe_mode(mode, options)
    weights, index = moe_routing(options, rng)
    floats = {
        "x": rng.standard_normal((t, d)),
        "gate_up": rng.standard_normal((e, 2 * i, d)),
        "down": rng.standard_normal((e, d, i)),
        "weights": weights,
    }

    def run(a, _):
        return moe.run(how, a["x"], a["gate_up"], a["down"], a["weights"], a["index"])

    return Case(
        floats=floats,
        ints={"index": index},
        layouts={
            "x": "[T, D] (token rows of the step)",
            "gate_up": "[E, 2I, D] (the checkpoint's fused experts.gate_up_proj: gate rows "
            "0:I, up rows I:2I)",
            "down": "[E, D, I] (experts.down_proj)",
            "weights": "[T, K] router weights of each token's picks",
            "index": "[T, K] the picked experts (distinct per token)",
        },
        out_layout="[T, D]: sum over k of weights[t, k] * down[e] @ (gelu_tanh(gate[e] @ x[t]) "
        "* (up[e] @ x[t])), e = index[t, k]",
        reference=f"ref.gemma4.moe.run({str(how)!r}, x, gate_up, down, weights, index)",
        run=run,
        scalars={},
        extra={
            "moe_mode": str(how),
            "inputs_note": "x, gate_up, down: standard normal (numpy default_rng(seed)); "
            "index, weights: the top-k of standard normal router logits [T, E] and the softmax "
            "over those k (ref.gemma4.moe.route with per_expert_scale 1), the first `hot` "
            "tokens' first pick forced to expert 0; floats rounded to every precision asked for",
            "routed_per_expert": np.bincount(index.reshape(-1), minlength=e).tolist(),
        },
    )


def make_case(op, mode, options, rng):
    if op == "attention":
        return _attention_case(mode, options, rng)
    if op == "moe":
        return _moe_case(mode, options, rng)
    builders = {
        "cache_update": _cache_update_case,
        "vision_attention": _vision_attention_case,
        "audio_attention": _audio_attention_case,
        "pool": _pool_case,
        "rope2d": _rope2d_case,
    }
    return builders[op](options, rng)
