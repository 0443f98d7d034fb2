"""Tensor-parallel sharding of Gemma 4 over a JAX device mesh: one table, by parameter name.

`RULES` says which dim of a tensor is split: attention heads and KV heads (q/k/v rows, o
columns), the MLP's and the experts' hidden dim, the vocabulary of the token embeddings (and
so of the tied logits), and the KV cache's heads. Every other tensor — norms, router, clip
bounds, scalars, patch embedder, position table, embed_vision, PLE projections, cache
positions — is replicated. A split dim goes over all the mesh's axes together (a (2, 4) mesh
splits it 8 ways, like an (8,) mesh; only which device holds which slice differs).

A dim the mesh size does not divide is replicated instead (`unsplit` lists those tensors):
e.g. the 31B's full-attention layers have 4 KV heads, so on 8 devices their k_proj and cache
are whole on every device. Values never depend on the layout: XLA's SPMD partitioner
computes the same function for any sharding, only the communication differs.

Arrays are built slice by slice (`jax.make_array_from_callback`): each device asks its
source leaf for its block only, so a leaf that reads blocks from a file (`weights`'
`LazyTensor`) puts no whole tensor on a host; numpy arrays work the same way.
"""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# (pattern, dim): a tensor whose dotted name matches `pattern` (re.search) is split along
# `dim` over the mesh. Parameter names are the checkpoint's (HF [out, in] layout); cache names
# are `init_cache`'s keys ("k.3" = keys of layer 3, [B, Hkv, T, hd]).
RULES = (
    (r"(^|\.)(embed_tokens|embed_tokens_per_layer|lm_head)\.weight$", 0),  # [V, D]: vocab
    (r"self_attn\.[qkv]_proj(\.linear)?\.weight$", 0),  # [heads·hd, D]: (KV) heads
    (r"self_attn\.o_proj(\.linear)?\.weight$", 1),  # [D, heads·hd]: heads
    (r"mlp\.(gate|up)_proj(\.linear)?\.weight$", 0),  # [F, D]: hidden
    (r"mlp\.down_proj(\.linear)?\.weight$", 1),  # [D, F]: hidden
    (r"experts\.gate_up_proj$", 1),  # [E, 2I, D]: expert hidden
    (r"experts\.down_proj$", 2),  # [E, D, I]: expert hidden
    (r"^[kv]\.\d+$", 1),  # cache [B, Hkv, T, hd]: KV heads
)


def auto_axes(mesh):
    """`mesh` with every axis Auto (None stays None): the same devices and axis names. An
    explicit-axis mesh (`jax.make_mesh`'s default in JAX 0.10) types each array with its
    sharding and refuses ops whose output sharding is ambiguous (a contraction over a split
    dim, a reshape of one); `ref` places its parameters and caches by `RULES` and leaves the
    intermediates to XLA's partitioner, which needs Auto axes. Values do not depend on it."""
    if mesh is None or all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def rule_dim(name):
    """The dim `RULES` splits for a dotted name, or None (replicated)."""
    for pattern, dim in RULES:
        if re.search(pattern, name):
            return dim
    return None


def partition_spec(name, shape, mesh):
    """PartitionSpec of one tensor on `mesh`: its rule's dim over all the mesh's axes, or
    replicated (no rule, or a dim the mesh size does not divide). shape: the tensor's."""
    dim = rule_dim(name)
    if dim is None or len(shape) <= dim or shape[dim] % mesh.size:
        return P()
    return P(*(None,) * dim, tuple(mesh.axis_names))


def unsplit(tree, mesh, prefix=""):
    """{dotted name: (shape, dim)} of the tensors a rule splits but the mesh size does not
    divide (replicated instead)."""
    out = {}
    for name, leaf in _named_leaves(tree, prefix):
        dim = rule_dim(name)
        if dim is not None and partition_spec(name, leaf.shape, mesh) == P():
            out[name] = (tuple(leaf.shape), dim)
    return out


def shardings(tree, mesh, prefix=""):
    """NamedSharding of every leaf (anything with a `.shape`) by `RULES`; same tree structure.
    prefix: prepended to the leaves' dotted names (a subtree's place in the checkpoint)."""
    named = _named_leaves(tree, prefix)
    specs = [NamedSharding(mesh, partition_spec(n, leaf.shape, mesh)) for n, leaf in named]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), specs)


def put(tree, dtype, mesh=None, prefix=""):
    """The leaves as jax arrays of `dtype`: on the default device (mesh None), or split over
    `mesh` by `RULES`, each device's block read from its leaf alone (`leaf[index]`) and cast.

    tree: leaves with `.shape` and numpy-style `[tuple of slices]` indexing (numpy arrays,
    `weights.LazyTensor`, jax arrays).
    """
    if mesh is None:
        return jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), tree)
    dtype = jnp.dtype(dtype)
    # one tensor at a time: left asynchronous, the host blocks of many tensors wait for their
    # device copies together (31B, 2 layers, bf16: load peak 1.98 GiB above the weights on one
    # device, 0.8 GiB when each tensor is waited for)
    return jax.tree_util.tree_map(
        lambda leaf, sharding: jax.make_array_from_callback(
            tuple(leaf.shape), sharding, partial(_block, leaf, dtype)
        ).block_until_ready(),
        tree,
        shardings(tree, mesh, prefix),
    )


def constrain(tree, mesh, prefix=""):
    """Inside jit: every leaf constrained to the table's sharding on `mesh`."""
    return jax.lax.with_sharding_constraint(tree, shardings(tree, mesh, prefix))


def sharded(make, mesh):
    """`make()` → tree of arrays, created on `mesh` in the table's sharding (each device makes
    its block; no device holds the whole). make: a function of no arguments (e.g. a
    `functools.partial` of `init_cache`)."""
    if mesh is None:
        return make()
    return jax.jit(make, out_shardings=shardings(jax.eval_shape(make), mesh))()


def device_bytes(tree):
    """{device: bytes of the tree's arrays it holds} (addressable shards only)."""
    held = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def _block(leaf, dtype, index):
    return np.asarray(leaf[index]).astype(dtype, copy=False)


def _named_leaves(tree, prefix):
    """[(dotted name, leaf)] in the tree's flattening order."""
    pairs = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(prefix + ".".join(_key(k) for k in path), leaf) for path, leaf in pairs]


def _key(k):
    return str(getattr(k, "key", getattr(k, "idx", k)))
