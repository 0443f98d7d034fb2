"""Packed vision attention block by block: query tiles × KV tiles with the online-softmax state.

A dense segment mask over a packed sequence of N patches holds H·N² scores at once (16 heads ×
10080² floats at budget 1120: 6.5 GB). Here each query tile runs through the KV tiles in turn,
carrying `ref.attention`'s state (m, l, O), so the scores of one tile, [H, N/q_tiles,
N/kv_tiles], are live at a time. The loops are unrolled in Python over static bounds (an export
has no Loop op); the bounds are expressions of N, so a symbolic N traced for export stays
symbolic. Each tile's mask comes from `segment_ids` (data): a patch attends to the patches of
its own item, filler (−1) attends to nothing and gets zeros. One tile each way is the dense
masked attention.
"""

import jax.numpy as jnp
from jax import lax

from ref.attention import _finish, _step, after


def segment_mask(q_ids, kv_ids):
    """Same item and not filler: q_ids [S], kv_ids [T] int → [S, T] bool."""
    return (q_ids[:, None] == kv_ids[None, :]) & (q_ids[:, None] >= 0)


def tile_bounds(n, tiles):
    """`tiles` [start, end) bounds of n // tiles rows over [0, n), the last one ending at n (it
    takes the remainder where tiles does not divide n); n may be a symbolic dimension."""
    size = n // tiles
    return [(i * size, n if i == tiles - 1 else (i + 1) * size) for i in range(tiles)]


def check_tiles(tiles, n):
    """(query tiles, KV tiles) as ints ≥ 1, each at most n when n is concrete; ValueError
    naming the bad value otherwise."""
    if not isinstance(tiles, tuple) or len(tiles) != 2:
        raise ValueError(f"tiles {tiles!r}: expected a pair (query tiles, KV tiles)")
    for name, t in zip(("query", "KV"), tiles, strict=True):
        if not isinstance(t, int) or isinstance(t, bool) or t < 1:
            raise ValueError(f"{name} tiles {t!r}: expected an int >= 1")
        if isinstance(n, int) and t > n:
            raise ValueError(f"{name} tiles {t}: more than the {n} patches")
    return tiles


def _slice(x, bounds, axis):
    return lax.slice_in_dim(x, bounds[0], bounds[1], axis=axis)


def tiled_packed_attention(q, k, v, segment_ids, tiles=(1, 1)):
    """Bidirectional attention inside each packed item, scale 1, tile by tile.

    q: [N, H, D]; k, v: [N, Hkv, D] (kv head j serves query heads j·g … j·g+g−1);
    segment_ids: [N] int (−1 = filler); tiles: (query tiles, KV tiles) → [N, H, D].
    """
    n, h, d = q.shape
    hkv = k.shape[1]
    if h % hkv:
        raise ValueError(f"query heads {h} must be a multiple of kv heads {hkv}")
    q_tiles, kv_tiles = check_tiles(tiles, n)
    q5 = jnp.swapaxes(q, 0, 1).reshape(1, hkv, h // hkv, n, d)
    kh, vh = jnp.swapaxes(k, 0, 1)[None], jnp.swapaxes(v, 0, 1)[None]
    kv = [
        (_slice(kh, b, 2), _slice(vh, b, 2), _slice(segment_ids, b, 0))
        for b in tile_bounds(n, kv_tiles)
    ]
    outs, last = [], None
    for bounds in tile_bounds(n, q_tiles):
        qt, q_ids, state = _slice(q5, bounds, 3), _slice(segment_ids, bounds, 0), None
        for kt, vt, kv_ids in kv:
            if last is not None:
                # The tile's queries and mask depend on the tile before (`after`, exact), as in
                # `ref.attention.blocked(ordered=True)`: otherwise a runtime may make every
                # tile's scores or mask first (onnxruntime did: 9×9 peaked as dense).
                qt, q_ids = after(last, qt, q_ids)
            mask = segment_mask(q_ids, kv_ids)
            state = last = _step(state, qt, kt, vt, mask, scale=1.0, softcap=None)
        outs.append(_finish(state, q.dtype))
    # lax.concatenate: jax2onnx's jnp.concatenate declares a wrong size along a symbolic axis.
    out = outs[0] if len(outs) == 1 else lax.concatenate(outs, 3)
    return jnp.swapaxes(out.reshape(h, n, d), 0, 1)
