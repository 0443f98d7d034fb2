"""The `vision` graph: the packed Gemma 4 vision tower (then embed_vision in a full model) over
`num_patches` patches pooled to `vision_size` soft tokens, one specialization per budget."""

import flax.linen as nn
import numpy as np

from codegen.graphs import GraphError, GraphSpec, Tensor, eager_reference, route_layers
from ref.blocking import VISION_TILES
from ref.gemma4 import vision as V
from ref.gemma4.config import VisionConfig
from ref.gemma4.images import BUDGETS
from ref.gemma4.packing import pack
from ref.gemma4.params import VISION, nested, vision_param_shapes
from ref.gemma4.tower import tower_apply
from weights import check_shapes


def vision_prefix(tensor_names):
    """Where the tower's names start: "model.vision_tower." in a full Gemma 4 checkpoint
    ("vision_tower." in some saves), "" in a saved vision model; None without a tower."""
    for prefix in (VISION, VISION.removeprefix("model."), ""):
        if prefix + "patch_embedder.input_proj.weight" in tensor_names:
            return prefix
    return None


def embed_vision_name(prefix):
    """The embed_vision projection's name beside a tower under `prefix`."""
    return prefix.replace("vision_tower.", "embed_vision.") + "embedding_projection.weight"


def _subtree(params, prefix):
    for key in prefix.rstrip(".").split(".") if prefix else ():
        params = params[key]
    return params


def _VISION_LAYER(module):
    return "Layer"


def _vision_forward(cfg, prefix, names, use_functions, embed, *, tiles, per_item=False):
    """fn(patches, positions, segment_ids, pool_index, *weights) → (embeddings,); attention
    in (query, KV) `tiles`, or per item on cu_seqlens read from segment_ids (per_item: eager
    only, for the reference)."""

    def fn(patches, positions, segment_ids, pool_index, *weights):
        params = nested(names, weights)
        embed_params = None
        if embed:
            embed_params = _subtree(params, embed_vision_name(prefix).rsplit(".", 2)[0])
        with nn.intercept_methods(route_layers(V.EncoderLayer, use_functions, _VISION_LAYER)):
            out = tower_apply(
                _subtree(params, prefix),
                embed_params,
                patches,
                positions,
                segment_ids,
                pool_index,
                config=cfg,
                cu_seqlens=cu_seqlens(segment_ids) if per_item else None,
                tiles=tiles,
                keep_states=False,
            )
        return (out["embeds"] if embed else out["pooled"],)

    return fn


def cu_seqlens(segment_ids):
    """The item offsets (static tuple) of packed segment_ids [N]: items 0, 1, … in order,
    then filler (−1)."""
    ids = np.asarray(segment_ids)
    counts = np.bincount(ids[ids >= 0])
    cu = (0, *(int(c) for c in np.cumsum(counts)))
    if not np.array_equal(ids[: cu[-1]], np.repeat(np.arange(len(counts)), counts)):
        raise GraphError("segment_ids are not items 0, 1, … in order followed by filler (-1)")
    return cu


def _vision_sample(cfg):
    def sample(symbols, rng):
        """Random images packed into exactly `vision_size` soft tokens (filler included)."""
        k = cfg.pooling_kernel_size
        budget = symbols["vision_size"]
        grids, used = [], 0
        side_max = max(1, min(cfg.position_embedding_size, 12 * k) // k)
        while used < budget and len(grids) < 4:
            th, tw = (int(t) for t in rng.integers(1, side_max + 1, 2))
            if used + th * tw > budget:
                break
            grids.append((th * k, tw * k))
            used += th * tw
        if not grids:
            grids = [(k, k)]
        packing = pack(
            grids,
            pooling_kernel_size=k,
            position_embedding_size=cfg.position_embedding_size,
            budget=budget,
        )
        n = packing.positions.shape[0]
        return {
            "pixel_patches": rng.random((n, cfg.patch_dim), dtype=np.float32),
            "positions": packing.positions,
            "segment_ids": packing.segment_ids,
            "pool_index": packing.pool_index,
        }

    return sample


def vision_graph(
    checkpoint_config, tensor_shapes, budgets, *, use_functions=True, tiles=VISION_TILES
):
    """The packed vision tower over `num_patches` patches pooled to `vision_size` tokens.

    tensor_shapes: {checkpoint name: shape}. One specialization per soft-token budget. tiles:
    (query tiles, KV tiles) of each layer's attention (`check_tiles`); (1, 1) is the dense
    segment mask. The reference attends per item (cu_seqlens), not by the tiles exported.
    """
    cfg = VisionConfig.from_hf(checkpoint_config)
    tiles = check_tiles(tiles, budgets, cfg.pooling_kernel_size**2)
    prefix = vision_prefix(tensor_shapes)
    if prefix is None:
        raise GraphError("no vision tower: missing tensor 'patch_embedder.input_proj.weight'")
    expected = {prefix + n: s for n, s in vision_param_shapes(cfg).items()}
    embed = prefix != "" and cfg.text_hidden_size is not None
    if embed:
        expected[embed_vision_name(prefix)] = (cfg.text_hidden_size, cfg.hidden_size)
    check_shapes(tensor_shapes, expected, "checkpoint")
    names = tuple(sorted(expected))
    k2 = cfg.pooling_kernel_size**2
    width = cfg.text_hidden_size if embed else cfg.hidden_size
    inputs = (
        Tensor("pixel_patches", ("num_patches", cfg.patch_dim), "float32"),
        Tensor("positions", ("num_patches", 2), "int32"),
        Tensor("segment_ids", ("num_patches",), "int32"),
        Tensor("pool_index", ("vision_size", k2), "int32"),
    )
    outputs = (Tensor("vision_embeds" if embed else "pooled", ("vision_size", width), "float32"),)
    specs = tuple(
        {"name": f"vision_{b}", "symbols": {"num_patches": b * k2, "vision_size": b}}
        for b in budgets
    )
    fn = _vision_forward(cfg, prefix, names, use_functions, embed, tiles=tiles)
    plain = _vision_forward(cfg, prefix, names, False, embed, tiles=tiles, per_item=True)

    return GraphSpec(
        name="vision",
        kind="vision",
        options={"budgets": list(budgets), "tiles": list(tiles)},
        inputs=inputs,
        outputs=outputs,
        weights=names,
        fn=fn,
        reference=eager_reference(plain, inputs, outputs, names),
        sample=_vision_sample(cfg),
        specializations=specs,
    )


def check_budgets(budgets, ctx_len):
    """Soft-token budgets must be known sizes and fit the text context (vision_size < ctx_len)."""
    for b in budgets:
        if b not in BUDGETS:
            raise GraphError(f"budget {b}: expected one of {BUDGETS}")
        if ctx_len is not None and not b < ctx_len:
            raise GraphError(f"vision_size {b} must be < ctx_len {ctx_len}")
    if len(set(budgets)) != len(budgets):
        raise GraphError(f"budgets {list(budgets)} repeat a value")


def check_tiles(tiles, budgets, patches_per_token):
    """(query tiles, KV tiles) as a tuple of ints ≥ 1 that divide every budget's num_patches
    (budget · patches_per_token), so every tile of every specialization has one static size;
    GraphError naming the bad value otherwise."""
    tiles = tuple(tiles)
    if len(tiles) != 2 or not all(isinstance(t, int) and t >= 1 for t in tiles):
        raise GraphError(f"vision tiles {list(tiles)}: expected two ints >= 1 (query, KV)")
    for b in budgets:
        n = b * patches_per_token
        for name, t in zip(("query", "KV"), tiles, strict=True):
            if n % t:
                divisors = [d for d in range(1, 31) if n % d == 0]
                raise GraphError(
                    f"vision tiles {tiles[0]}x{tiles[1]}: {t} {name} tiles do not divide "
                    f"num_patches {n} (budget {b}); counts that do, up to 30: {divisors}"
                )
    return tiles
