"""`VisionTower`: the packed vision tower with its parameters, and its jit-compiled forward."""

from importlib.metadata import entry_points

import jax
import jax.numpy as jnp
import numpy as np

from ref import sharding
from ref.gemma4.config import VisionConfig
from ref.gemma4.images import preprocess
from ref.gemma4.packing import pack, pack_patches
from ref.gemma4.params import VISION
from ref.gemma4.vision import EmbedVision, VisionModel

LOADER_GROUP = "gemma4_qaic.checkpoint_loaders"


def tower_apply(
    params,
    embed_params,
    patches,
    positions,
    segment_ids,
    pool_index,
    *,
    config,
    cu_seqlens=None,
    tiles=(1, 1),
    keep_states=True,
):
    """The packed tower (not compiled; `tower_forward` is its jit); `embed_params=None` skips
    embed_vision; tiles: (query tiles, KV tiles) of the masked attention (without cu_seqlens).

    patches: [N, 3·p·p]; positions: [N, 2]; segment_ids: [N]; pool_index: [M, k²] →
    {"pooled": [M, D], "hidden_states": L+1 × [N, D] (() unless keep_states), "embeds":
    [M, text_hidden] or absent}.
    """
    out = VisionModel(config, cu_seqlens, tiles, keep_states).apply(
        {"params": params}, patches, positions, segment_ids, pool_index
    )
    if embed_params is not None:
        out["embeds"] = EmbedVision(config).apply({"params": embed_params}, out["pooled"])
    return out


tower_forward = jax.jit(
    tower_apply, static_argnames=("config", "cu_seqlens", "tiles", "keep_states")
)


def checkpoint_loader():
    """The checkpoint reader installed by the `weights` package, found by entry point.

    `ref` never reads files itself: the reader is a plug-in, so this package stays pure.
    """
    found = {ep.name: ep for ep in entry_points(group=LOADER_GROUP)}
    if "safetensors" not in found:
        raise RuntimeError(
            f"no checkpoint loader registered under entry point group {LOADER_GROUP!r}: "
            "install the project (pip install -e .) so that `weights` provides one"
        )
    return found["safetensors"].load()


def split_tree(
    params, tower="vision_tower", embed="embed_vision", alone=("encoder", "patch_embedder")
):
    """(`tower` subtree, `embed` subtree or None) of a tower-only or full checkpoint's tree; a
    tower saved alone is known by its top-level keys `alone`."""
    model = params.get("model")
    if isinstance(model, dict) and tower in model:
        return model[tower], model.get(embed)
    if tower in params:
        return params[tower], params.get(embed)
    if all(k in params for k in alone):
        return params, None
    what = tower.removesuffix("_tower")
    raise ValueError(
        f"parameter tree with top-level keys {sorted(params)[:8]} holds no Gemma 4 {what} "
        f"tower: expected model.{tower}.* or {'/'.join(f'{k}.*' for k in alone)}"
    )


class VisionTower:
    """The packed Gemma 4 vision tower with its parameters, ready to encode images."""

    def __init__(self, config, params, embed_params=None, dtype=jnp.float32, mesh=None):
        """mesh: None (one device) or a `jax.sharding.Mesh` the parameters are split over by
        `ref.sharding.RULES`, each device's blocks read from the leaves alone (explicit axes
        are used as Auto: `sharding.auto_axes`)."""
        mesh = sharding.auto_axes(mesh)
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.params = sharding.put(params, self.dtype, mesh, VISION)
        self.embed_params = None
        if embed_params is not None:
            self.embed_params = sharding.put(embed_params, self.dtype, mesh, "model.embed_vision.")

    @classmethod
    def from_params(cls, hf_config, params, dtype=jnp.float32, mesh=None):
        """From an HF config dict and a checkpoint tree (vision-only or full model)."""
        vision, embed = split_tree(params)
        return cls(VisionConfig.from_hf(hf_config), vision, embed, dtype, mesh)

    @classmethod
    def from_pretrained(cls, model_dir, dtype=jnp.float32, mesh=None):
        """From an HF model folder (config.json + safetensors), read by the `weights` package;
        with a mesh, each device reads only its blocks from the files' byte ranges."""
        hf_config, params = checkpoint_loader()(model_dir, lazy=mesh is not None)
        return cls.from_params(hf_config, params, dtype, mesh)

    def pack(self, patches, grids, budget=None):
        """(Packing, packed patches [N, 3·p·p]) for per-item patches and (h, w) grids."""
        c = self.config
        packing = pack(
            grids,
            pooling_kernel_size=c.pooling_kernel_size,
            position_embedding_size=c.position_embedding_size,
            budget=budget,
        )
        return packing, pack_patches(patches, packing.grids, c.patch_dim, packing)

    def run(self, patches, grids, *, budget=None, embed=False, varlen=True):
        """The packed forward and its metadata: (Packing, output dict of `tower_forward`).

        varlen=True attends per item on static slices (exact block-diagonal work);
        varlen=False uses the dense segment mask over the whole (budgeted) sequence.
        """
        if embed and self.embed_params is None:
            raise ValueError("embed needs embed_vision weights: load a full Gemma 4 checkpoint")
        packing, flat = self.pack(patches, grids, budget)
        out = tower_forward(
            self.params,
            self.embed_params if embed else None,
            jnp.asarray(flat, self.dtype),
            packing.positions,
            packing.segment_ids,
            packing.pool_index,
            config=self.config,
            cu_seqlens=packing.cu_seqlens_static if varlen else None,
        )
        return packing, out

    def encode(self, patches, grids, *, budget=None):
        """Soft tokens per item: list of [h_i·w_i/k², vision_hidden] (HF's last_hidden_state).

        patches[i]: [h_i·w_i, 3·p·p] in [0, 1], row-major; grids[i] = (h_i, w_i) in patches.
        """
        packing, out = self.run(patches, grids, budget=budget)
        return _split(np.asarray(out["pooled"]), packing)

    def embed(self, patches, grids, *, budget=None):
        """Soft tokens after embed_vision: list of [h_i·w_i/k², text_hidden]."""
        packing, out = self.run(patches, grids, budget=budget, embed=True)
        return _split(np.asarray(out["embeds"]), packing)

    def preprocess(self, images, max_soft_tokens=280):
        """(patches, grids) of images [H, W, 3|4] or [H, W] uint8, as Gemma 4's image processor
        makes them for this tower's patch and pooling sizes (`ref.gemma4.images.preprocess`)."""
        c = self.config
        return preprocess(
            images,
            max_soft_tokens,
            patch_size=c.patch_size,
            pooling_kernel_size=c.pooling_kernel_size,
        )

    def encode_images(self, images, max_soft_tokens=280):
        """Soft tokens per image, straight from pixels: `encode(*preprocess(images, M))`."""
        return self.encode(*self.preprocess(images, max_soft_tokens))


def _split(tokens, packing):
    """Per-item slices of packed soft tokens [M, F] → list of [m_i, F]."""
    cu = packing.cu_tokens
    return [tokens[a:b] for a, b in zip(cu[:-1], cu[1:], strict=True)]
