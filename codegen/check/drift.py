"""`python -m codegen drift`: greedy tokens of float32 `ref` against the device model of
`ref.numerics` (every tensor in the compute format, the KV cache stored in `--kv-dtype`
between steps, with `--mxfp6` the matmul weights stored as MXFP6: `ref.mxfp6`) over random
prompts with an image each (docs/precision.md); a tower or, for the 12B Unified, its vision
embedder in the device model too."""

import copy
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from codegen.check.precision import table
from ref import mxfp6 as mx
from ref import numerics
from ref.gemma4.step import apply_step
from ref.gemma4.tower import tower_apply
from ref.gemma4.unified import VisionEmbedder
from ref.gemma4.unified_model import UnifiedVision


@partial(jax.jit, static_argnames=("config", "attention", "precision", "kv_dtype"))
def _device_step(params, lm_head, cache, *inputs, config, attention, precision, kv_dtype):
    step = partial(apply_step, config=config, attention=attention, last_only=True)
    out = numerics.emulate(step, precision)(params, lm_head, cache, *inputs)
    return dict(out, cache=numerics.store_kv(out["cache"], kv_dtype))


@partial(jax.jit, static_argnames=("config", "precision"))
def _device_tower(params, embed_params, patches, positions, segment_ids, pool_index, *, config,
                  precision):  # fmt: skip
    fn = partial(tower_apply, config=config)
    return numerics.emulate(fn, precision)(
        params, embed_params, patches, positions, segment_ids, pool_index
    )["embeds"]


class DeviceVision:
    """A VisionTower's `embed` in the device model (dense segment mask, as exported)."""

    def __init__(self, tower, precision):
        self.tower, self.precision = tower, precision
        self.config = tower.config

    def embed(self, patches, grids):
        """Soft tokens per item after embed_vision: list of [h_i·w_i/k², text_hidden]."""
        packing, flat = self.tower.pack(patches, grids)
        out = np.asarray(
            _device_tower(
                self.tower.params,
                self.tower.embed_params,
                jnp.asarray(flat, jnp.float32),
                packing.positions,
                packing.segment_ids,
                packing.pool_index,
                config=self.config,
                precision=self.precision,
            )
        )
        cu = packing.cu_tokens
        return [out[a:b] for a, b in zip(cu[:-1], cu[1:], strict=True)]


@partial(jax.jit, static_argnames=("config", "precision"))
def _device_embedder(params, patches, positions, *, config, precision):
    def fn(p, x, at):
        return VisionEmbedder(config).apply({"params": p}, x, at)

    return numerics.emulate(fn, precision)(params, patches, positions)


def device_embedder(vision, precision):
    """A copy of a 12B Unified's `UnifiedVision` whose embedder runs in the device model (its
    checks and packing unchanged)."""
    other = copy.copy(vision)
    other.apply = partial(_device_embedder, precision=precision)
    return other


def with_mxfp6(model, element):
    """A copy of a `Gemma4` whose matmul weights (text, lm_head, vision tower and
    embed_vision, or the 12B Unified's vision embedder) are as MXFP6 stores them
    (`ref.mxfp6.matmul_weights`); the model unchanged."""
    other = copy.copy(model)
    other.params = mx.matmul_weights(model.params, element)
    if model.lm_head is not None:
        other.lm_head = mx.round_trip(model.lm_head, element)
    if model.vision is not None:
        other.vision = copy.copy(model.vision)
        other.vision.params = mx.matmul_weights(model.vision.params, element)
        if not isinstance(model.vision, UnifiedVision):
            other.vision.embed_params = mx.matmul_weights(model.vision.embed_params, element)
    return other


class DeviceGemma4:
    """A `Gemma4` whose every text step (and vision tower) runs in the device model: compute
    in `precision`, KV cache stored as `kv_dtype` (`Gemma4.with_step`), matmul weights as
    MXFP6 with element `mxfp6` when given; records each step's logits in `self.logits`."""

    def __init__(self, model, precision, kv_dtype, mxfp6=None):
        self.precision = numerics.format_name(precision)
        self.kv_dtype = numerics.format_name(kv_dtype, numerics.KV_FORMATS)
        if mxfp6 is not None:
            model = with_mxfp6(model, mxfp6)
        vision = model.vision
        if isinstance(vision, UnifiedVision):
            vision = device_embedder(vision, self.precision)
        elif vision is not None:
            vision = DeviceVision(vision, self.precision)
        self.model = model.with_step(self._step, vision)
        self.vision = self.model.vision
        self.logits = []

    def _step(self, *args, config, attention):
        out = _device_step(*args, config=config, attention=attention,
                           precision=self.precision, kv_dtype=self.kv_dtype)  # fmt: skip
        self.logits.append(np.asarray(out["logits"][:, -1], np.float32))
        return out

    def generate(self, *args, **options):
        """`Gemma4.generate` in the device model."""
        return self.model.generate(*args, **options)


def random_prompt(model, rng, *, text_len=6):
    """(ids [L], patches, grids): random words (ids ≥ 7, none special), one random image
    (2–4 × 2–4 soft tokens) between the begin/end-of-image tokens, random words; the grid in
    the model's patches (a tower's, pooled k × k; the 12B Unified's 48-px blocks)."""
    vision = model.vision.config
    k = model.media_sizes()["pooling_kernel_size"]
    th, tw = (int(t) for t in rng.integers(2, 5, 2))
    grid = (th * k, tw * k)
    patches = rng.random((grid[0] * grid[1], vision.patch_dim), dtype=np.float32)
    t = model.tokens
    special = {t.image_token_id, t.boi_token_id, t.eoi_token_id, t.video_token_id}
    words = [w for w in range(7, model.config.vocab_size) if w not in special]

    def text(n):
        return [int(w) for w in rng.choice(words, n)]

    ids = text(text_len) + [model.tokens.boi_token_id]
    ids += [model.tokens.image_token_id] * (th * tw) + [model.tokens.eoi_token_id]
    ids += text(text_len)
    return np.asarray(ids, np.int32), [patches], [grid]


def drift(model, *, prompts, precision, kv_dtype, max_new_tokens=8, seed=0, mxfp6=None):
    """Greedy tokens of float32 `model` against the device model (matmul weights as MXFP6 with
    element `mxfp6` when given) over `prompts` random prompts with an image each → list of
    per-prompt dicts: agree (tokens equal), first divergence step (None if none), the float32
    top-2 logit gap there."""
    device = DeviceGemma4(model, precision, kv_dtype, mxfp6)
    exact = DeviceGemma4(model, "float32", "float32")
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(prompts):
        ids, patches, grids = random_prompt(model, rng)
        exact.logits, device.logits = [], []
        # no stop ids: both sides run max_new_tokens, compared step by step
        fixed = dict(max_new_tokens=max_new_tokens, stop=())
        want = exact.generate(ids[None], patches, grids, **fixed)[0]
        got = device.generate(ids[None], patches, grids, **fixed)[0]
        differ = np.flatnonzero(want != got)
        first = int(differ[0]) if differ.size else None
        gap = None
        if first is not None:
            top2 = np.sort(exact.logits[first][0])[-2:]
            gap = float(top2[1] - top2[0])
        rows.append({"agree": int(np.sum(want == got)), "total": len(want), "first": first,
                     "gap": gap})  # fmt: skip
    return rows


def drift_table(rows, precision, kv_dtype, mxfp6=None):
    """The `drift` report: one row per prompt and the agreement rate."""
    body = [
        (i, f"{r['agree']}/{r['total']}", "-" if r["first"] is None else r["first"],
         "-" if r["gap"] is None else f"{r['gap']:.3g}")
        for i, r in enumerate(rows)
    ]  # fmt: skip
    agree = sum(r["agree"] for r in rows)
    total = sum(r["total"] for r in rows)
    same = sum(r["first"] is None for r in rows)
    head = ("prompt", "tokens equal", "first divergence", "float32 top-2 gap there")
    return "\n".join(
        [
            f"float32 vs {precision} compute, KV cache {kv_dtype}"
            + ("" if mxfp6 is None else f", MXFP6 ({mxfp6}) matmul weights"),
            table(head, body),
            f"agreement {agree}/{total} = {agree / total:.1%}; {same}/{len(rows)} prompts "
            "identical",
        ]
    )
