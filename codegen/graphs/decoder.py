"""The Gemma 4 text decoder as the language graphs see it: where its weights start in a
checkpoint and which it takes (in call order, shapes checked against `ref`), the ONNX
function name of each decoder layer, the KV-cache tensors of the layers that own one, and
random inputs of a language graph's specialization (`model_sample`).
"""

import numpy as np

from codegen.graphs import Drawn, GraphError, Tensor, folded_rows
from codegen.graphs.ccl import CCL
from ref.gemma4.kv_cache import ring_slots
from ref.gemma4.params import TEXT, text_param_shapes
from ref.gemma4.text_config import SLIDING
from weights import check_shapes

LM_HEAD = "lm_head.weight"
TEXT_PREFIXES = (TEXT, "model.")


def text_prefix(tensor_names):
    """Where the decoder's names start ("model.language_model." in a Gemma 4 VLM, "model."
    in a text-only Gemma4ForCausalLM save), None without a decoder."""
    for prefix in TEXT_PREFIXES:
        if prefix + "embed_tokens.weight" in tensor_names:
            return prefix
    return None


def decoder_kinds(cfg):
    """The ONNX function name of each decoder layer: one per distinct layer structure
    (sliding/full × owns its cache or shares one × dense/MoE, then head layout)."""
    names, seen = [], {}
    for i in range(cfg.num_hidden_layers):
        base = "Sliding" if cfg.layer_types[i] == SLIDING else "Full"
        base += "Shared" if cfg.shares_kv(i) else ""
        base += "MoE" if cfg.enable_moe_block else ""
        shape = (cfg.head_dims[i], cfg.kv_heads[i])
        layouts = seen.setdefault(base, [])
        if shape not in layouts:
            layouts.append(shape)
        n = layouts.index(shape)
        names.append(f"{base}DecoderLayer" + (f"_{n + 1}" if n else ""))
    return tuple(names)


def cache_owners(cfg):
    """The layers that own a KV cache (KV-sharing consumers read their producer's)."""
    return [i for i in range(cfg.num_hidden_layers) if not cfg.shares_kv(i)]


def cache_tensors(cfg, ring, ctx_len, rows="batch_size", folded=False, drafts=0):
    """`past_key.{i}`, `past_value.{i}` of every cache owner i: [rows, Hkv, slots, D], slots
    the ring's (`ring_slots`: the sliding window, W + drafts + 1 when an export speculates,
    capped at ctx_len) for a sliding layer in a ring, else `ctx_len`; folded: [1, rows·Hkv,
    slots, D] (the batch-fold layout)."""
    window = ring_slots(cfg.sliding_window, ctx_len, drafts)
    out = []
    for i in cache_owners(cfg):
        slots = window if ring and cfg.layer_types[i] == SLIDING else "ctx_len"
        lead = (1, folded_rows(cfg, cfg.kv_heads[i])) if folded else (rows, cfg.kv_heads[i])
        shape = (*lead, slots, cfg.head_dims[i])
        out += [Tensor(f"past_{kind}.{i}", shape, "float32") for kind in ("key", "value")]
    return tuple(out)


def model_weights(cfg, tensor_shapes):
    """(checkpoint prefix, weight names in call order: the decoder's, then lm_head if the
    checkpoint has its own), after checking every shape against `ref`."""
    prefix = text_prefix(tensor_shapes)
    if prefix is None:
        raise GraphError(f"no text decoder: missing tensor '{TEXT}embed_tokens.weight'")
    expected = {prefix + n[len(TEXT) :]: s for n, s in text_param_shapes(cfg).items()}
    if LM_HEAD in tensor_shapes:
        expected[LM_HEAD] = (cfg.vocab_size, cfg.hidden_size)
    check_shapes(tensor_shapes, expected, "checkpoint")
    names = sorted(n for n in expected if n != LM_HEAD)
    return prefix, tuple(names) + ((LM_HEAD,) if LM_HEAD in expected else ())


def gathered(prefix, names):
    """The tables `ref` only gathers rows of: per-layer embeddings, and the token embeddings
    when the checkpoint has its own lm_head (else they are the logits' weights too)."""
    tables = [prefix + "embed_tokens_per_layer.weight"]
    if LM_HEAD in names:
        tables.append(prefix + "embed_tokens.weight")
    return tuple(n for n in tables if n in names)


def model_sample(cfg, vision, cache_in, symbols, rng):
    """Random inputs: per row positions from a random start with a padded tail (below the
    compute context length with one), text ids with a run of image tokens (prefill), random
    soft tokens, image_idx and caches (`Drawn`)."""
    b, s = symbols["batch_size"], symbols["seq_len"]
    t = symbols.get(CCL, symbols["ctx_len"])
    start = rng.integers(0, t - s + 1, (b, 1))
    pos = (start + np.arange(s)[None, :]).astype(np.int32)
    pad = rng.integers(0, s // 2 + 1, b) if s > 1 else np.zeros(b, int)
    pos[np.arange(s)[None, :] >= (s - pad)[:, None]] = -1
    special = {cfg.image_token_id, cfg.pad_token_id}
    ids = rng.integers(0, cfg.vocab_size, (b, s)).astype(np.int32)
    ids[np.isin(ids, list(special - {None}))] = (cfg.pad_token_id + 1) % cfg.vocab_size
    feed = {"input_ids": ids, "position_ids": pos}
    if vision:
        v = symbols["vision_size"]
        image_idx = np.zeros((b, 1), np.int32)
        for r in range(b):
            lo = int(rng.integers(0, s))
            hi = int(rng.integers(lo, min(s, lo + v) + 1))
            ids[r, lo:hi] = cfg.image_token_id
            image_idx[r, 0] = rng.integers(0, v - (hi - lo) + 1)
        feed["vision_embeds"] = rng.standard_normal((b, v, cfg.hidden_size), dtype=np.float32)
        feed["image_idx"] = image_idx
    if CCL in symbols:
        feed[CCL] = np.zeros(symbols[CCL], np.int64)  # its length is what the graph reads
    if "full_batch_size" in symbols:
        slots = rng.permutation(symbols["full_batch_size"])[:b].astype(np.int32)
        feed["batch_index"] = slots[:, None]
    for tensor in cache_in:
        feed[tensor.name] = Drawn(tensor.concrete(symbols), tuple(rng.integers(0, 2**63, 2)))
    return feed
