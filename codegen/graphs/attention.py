"""`attention_MODE` graphs (`--graphs attention`): stacks of Gemma 4 text attention layers
(`ref.gemma4.attention_stack`) in one blocking mode, each layer's KV cache as retained state —
what a kernel author compiles to study one mode on the model's real attention."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from codegen import graphs
from ref.cache import fold as fold_cache
from ref.cache import unfold
from ref.gemma4.attention_stack import AttentionLayer, AttentionLayers
from ref.gemma4.params import TEXT, attention_param_shapes, nested
from ref.gemma4.text_config import SLIDING
from weights import check_shapes

TEXT_LAYERS = TEXT + "layers."


def _cache_shape(cfg, i):
    return (cfg.kv_heads[i], cfg.head_dims[i])


def attention_layers_available(checkpoint_config, tensor_shapes):
    """How many leading text layers an attention graph can stack: layers that own their KV
    cache (KV-sharing consumers have none), whose tensors the checkpoint holds with the
    config's shapes, and whose head layout equals that of the first layer of their type
    (each layer type is one ONNX function, so its layers must share shapes)."""
    cfg = graphs.text_config(checkpoint_config)
    if cfg is None:
        return 0
    first_of_type = {}
    for i in range(cfg.num_hidden_layers):
        kind = cfg.layer_types[i]
        first = first_of_type.setdefault(kind, i)
        if cfg.shares_kv(i) or _cache_shape(cfg, i) != _cache_shape(cfg, first):
            return i
        if any(
            tuple(tensor_shapes.get(n, ())) != s for n, s in attention_param_shapes(cfg, i).items()
        ):
            return i
    return cfg.num_hidden_layers


def _group_ids(positions, rng):
    """Random vision runs [B, S] int32: per row one run of valid tokens (id = its first
    position, as `ref.gemma4.text.vision_runs` numbers them) or none; −1 elsewhere."""
    b, s = positions.shape
    groups = np.full((b, s), -1, np.int32)
    for r in range(b):
        valid = int(np.sum(positions[r] >= 0))
        if valid and rng.random() < 0.8:
            lo = int(rng.integers(0, valid))
            hi = int(rng.integers(lo + 1, valid + 1))
            groups[r, lo:hi] = positions[r, lo]
    return groups


def _attention_kind(module):
    """The ONNX function of a text attention layer: one per layer type."""
    kind = module.config.layer_types[module.layer]
    return "SlidingAttentionLayer" if kind == SLIDING else "FullAttentionLayer"


def attention_graph(
    checkpoint_config,
    tensor_shapes,
    *,
    name,
    mode,
    options,
    layers,
    batch_size,
    seq_len,
    ctx_len,
    use_functions=True,
):
    """A stack of the first `layers` Gemma 4 text attention layers in one blocking mode, each
    layer's KV cache as retained state (its own shape: full layers may have wider heads).

    Static shapes (block boundaries are compile-time constants); the graph's I/O carry the
    symbols batch_size, seq_len, ctx_len, bound by its one specialization.
    """
    cfg = graphs.text_config(checkpoint_config)
    if cfg is None:
        raise graphs.GraphError("no text_config: a vision-only checkpoint has no attention graphs")
    available = attention_layers_available(checkpoint_config, tensor_shapes)
    if not 1 <= layers <= available:
        raise graphs.GraphError(
            f"attention layers {layers}: the checkpoint has 1..{available} stackable layers "
            "(leading layers owning their KV cache, one head layout per layer type)"
        )
    if seq_len > ctx_len:
        raise graphs.GraphError(f"seq_len {seq_len} must be <= ctx_len {ctx_len}")
    config = graphs.blocking(
        mode, options, prefill=False, batch=batch_size, queries=seq_len, kv_len=ctx_len
    )
    try:
        for kv_heads in sorted({cfg.kv_heads[i] for i in range(layers)}) if config else ():
            config.plan(batch_size, cfg.num_attention_heads, kv_heads, seq_len, ctx_len)
    except ValueError as e:
        raise graphs.GraphError(f"blocking {mode!r} {options}: {e}") from e
    expected = {n: s for i in range(layers) for n, s in attention_param_shapes(cfg, i).items()}
    check_shapes(tensor_shapes, expected, "checkpoint")
    names = tuple(sorted(expected))
    fold = config is not None and config.batch_fold
    symbols = {"batch_size": batch_size, "seq_len": seq_len, "ctx_len": ctx_len}

    def cache_shape(i):
        kv_heads, hd = _cache_shape(cfg, i)
        if not fold:
            return ("batch_size", kv_heads, "ctx_len", hd)
        rows = graphs.folded_rows(cfg, kv_heads)
        symbols[rows] = batch_size * kv_heads
        return (1, rows, "ctx_len", hd)

    act = (
        graphs.Tensor("hidden_states", ("batch_size", "seq_len", cfg.hidden_size), "float32"),
        graphs.Tensor("position_ids", ("batch_size", "seq_len"), "int32"),
    )
    if cfg.bidirectional_vision:
        act += (graphs.Tensor("group_ids", ("batch_size", "seq_len"), "int32"),)
    cache_in = tuple(
        graphs.Tensor(f"past_{kind}.{i}", cache_shape(i), "float32")
        for i in range(layers)
        for kind in ("key", "value")
    )
    outputs = (graphs.Tensor("hidden_states_out", act[0].shape, "float32"),) + tuple(
        graphs.Tensor(t.name + "_RetainedState", t.shape, t.dtype) for t in cache_in
    )
    if use_functions:
        for kind in {_attention_kind(AttentionLayer(cfg, i, None)) for i in range(layers)}:
            graphs.layer_function(kind)
    stack = AttentionLayers(cfg, layers, config)
    dense = AttentionLayers(cfg, layers, None)
    n_act = len(act)

    def forward(module, routed):
        def fn(*args):
            (hidden_states, position_ids, *groups), caches = args[:n_act], args[n_act:]
            params = nested(names, caches[2 * layers :], TEXT_LAYERS)
            caches = caches[: 2 * layers]
            pairs = tuple(zip(caches[0::2], caches[1::2], strict=True))
            with nn.intercept_methods(graphs.route_layers(AttentionLayer, routed, _attention_kind)):
                h, new = module.apply(
                    {"params": params}, hidden_states, position_ids, pairs, tuple(groups)
                )
            return (h,) + tuple(x for pair in new for x in pair)

        return fn

    # One compiled program: eager, the unrolled blocks compile primitive by primitive.
    plain = jax.jit(forward(dense, False))

    def reference(feed, weights):
        args = [feed[t.name] for t in act + cache_in]
        if fold:
            args[n_act:] = [unfold(jnp.asarray(a), batch_size) for a in args[n_act:]]
        out = plain(*args, *(jnp.asarray(weights[n], jnp.float32) for n in names))
        out = [out[0]] + [fold_cache(x) if fold else x for x in out[1:]]
        return {t.name: np.asarray(x) for t, x in zip(outputs, out, strict=True)}

    def sample(sym, rng):
        """Contiguous positions from a random start (a prefix of the cache is history);
        a random tail of each row is padding (−1); a random vision run per row."""
        b, s, t = sym["batch_size"], sym["seq_len"], sym["ctx_len"]
        start = rng.integers(0, t - s + 1, (b, 1))
        pos = (start + np.arange(s)[None, :]).astype(np.int32)
        pad = rng.integers(0, s // 2 + 1, b)
        pos[np.arange(s)[None, :] >= (s - pad)[:, None]] = -1
        feed = {
            "hidden_states": rng.standard_normal((b, s, cfg.hidden_size), dtype=np.float32),
            "position_ids": pos,
        }
        if cfg.bidirectional_vision:
            feed["group_ids"] = _group_ids(pos, rng)
        for tensor in cache_in:
            feed[tensor.name] = rng.standard_normal(tensor.concrete(sym), dtype=np.float32)
        return feed

    return graphs.GraphSpec(
        name=name,
        kind="attention",
        options={
            "mode": mode,
            "blocking": dict(options),
            "layers": layers,
            "batch_size": batch_size,
            "seq_len": seq_len,
            "ctx_len": ctx_len,
        },
        inputs=act + cache_in,
        outputs=outputs,
        weights=names,
        fn=forward(stack, use_functions),
        reference=reference,
        sample=sample,
        specializations=({"name": "Prefill" if seq_len > 1 else "Decode", "symbols": symbols},),
        retained=tuple((t.name, t.name + "_RetainedState") for t in cache_in),
        static=tuple(symbols),
    )
