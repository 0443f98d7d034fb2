"""Gemma 4's mixture of experts (the 26B-A4B text model): the router and the experts as pure
functions, and the Linen modules with the checkpoint's names (`router.*`, `experts.*`).

The router gives each token its top-k experts and their weights; the experts run in one of the
modes of `ref.moe_modes` (QEfficient's names), each a small function of the same arguments and
the same answer: `dense` (every expert on every token), `gather` (each token's top-k experts'
matrices gathered) and `nsp` (experts split over cores, routed tokens packed into chunks).
All static shapes, no loops in the graph (blocks unrolled in Python), no `jax.nn.one_hot`
(ONNX OneHot is outside QAIC's op set): what an exported graph needs.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from ref.gemma4.text_config import TextConfig
from ref.layers import Weight, gelu_tanh, linear, rms_norm
from ref.moe_modes import MoeMode, parse


def route(x, proj, scale, per_expert_scale, top_k, eps):
    """Gemma4TextRouter: each token's top-k experts and their weights.

    x: [N, D]; proj: [E, D]; scale: [D]; per_expert_scale: [E] → (weights [N, K] in float32
    or wider: the top-k probabilities renormalized to sum 1, then scaled per expert; index
    [N, K] int32; among equal probabilities the lower expert first, as `lax.top_k`).
    """
    h = rms_norm(x, None, eps) * scale.astype(x.dtype) * (x.shape[-1] ** -0.5)
    probs = jax.nn.softmax(linear(h, proj).astype(_accumulator(x)), axis=-1)
    weights, index = jax.lax.top_k(probs, top_k)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights * per_expert_scale.astype(probs.dtype)[index], index.astype(jnp.int32)


def _accumulator(x):
    # float32 at least (transformers' bf16 router would round its probabilities), float64 in
    # a float64 check
    return jnp.promote_types(x.dtype, jnp.float32)


def _onehot(index, num_experts, dtype):
    """index: [N, K] → [N, K, E] in dtype, 1 where the k-th pick is expert e."""
    # a comparison, not jax.nn.one_hot: that exports as ONNX OneHot, outside QAIC's op set
    experts = lax.broadcasted_iota(index.dtype, (1, 1, num_experts), 2)
    return (index[:, :, None] == experts).astype(dtype)


def combine(weights, index, num_experts):
    """The router's dense routing matrix. weights, index: [N, K] → [N, E] (weights' dtype),
    zero outside each token's top-k."""
    return jnp.sum(_onehot(index, num_experts, weights.dtype) * weights[:, :, None], axis=1)


def dense(x, gate_up, down, weights, index):
    """Every expert's gated MLP on every token, mixed by the routing matrix.

    x: [N, D]; gate_up: [E, 2I, D]; down: [E, D, I]; weights, index: [N, K] → [N, D].
    """
    h = jnp.matmul(x[None], jnp.swapaxes(gate_up, 1, 2).astype(x.dtype))  # [E, N, 2I]
    gate, up = jnp.split(h, 2, axis=-1)
    y = jnp.matmul(gelu_tanh(gate) * up, jnp.swapaxes(down, 1, 2).astype(x.dtype))  # [E, N, D]
    mix = jnp.transpose(combine(weights, index, gate_up.shape[0]))[:, :, None]
    return jnp.sum(y.astype(_accumulator(x)) * mix, axis=0).astype(x.dtype)


def gather(x, gate_up, down, weights, index):
    """QEffGemma4TextExperts: each token's top-k experts' matrices gathered, batched matmuls,
    weighted and summed over k.

    x: [N, D]; gate_up: [E, 2I, D]; down: [E, D, I]; weights, index: [N, K] → [N, D].
    """
    n, k = index.shape
    d = x.shape[-1]
    picks = index.reshape(-1)  # [N·K]
    xk = jnp.broadcast_to(x[:, None, :], (n, k, d)).reshape(n * k, d, 1)
    # the fused gate_up gathered whole: QEfficient's split gate and up read the same bytes;
    # cast after the gather, so a bf16 checkpoint is read in bf16
    h = jnp.matmul(gate_up[picks].astype(x.dtype), xk)  # [N·K, 2I, 1]
    gate, up = jnp.split(h, 2, axis=1)
    y = jnp.matmul(down[picks].astype(x.dtype), gelu_tanh(gate) * up)  # [N·K, D, 1]
    y = y.reshape(n, k, d).astype(_accumulator(x)) * weights[:, :, None]
    return jnp.sum(y, axis=1).astype(x.dtype)


def slot_experts(w, slot, num_nsp):
    """[E, ...] → [num_nsp, ...]: the experts in slot `slot` of every core, core c's being expert
    slot·num_nsp + c (QEfficient's `view(local_experts, num_nsp, …).transpose(0, 1)`): a
    contiguous slice, so a graph reads each expert's weights once, in its slot's step."""
    return w[slot * num_nsp : (slot + 1) * num_nsp]


def pack(routed):
    """Each core's routed tokens first (in token order), then the rest.

    routed: [C, T] bool → (order [C, T] int32: the token in each packed row, count [C, 1]:
    routed tokens per core).
    """
    r = routed.astype(jnp.int32)
    count = jnp.sum(r, axis=1, keepdims=True)
    # QEfficient sends unrouted tokens to INT32_MAX and lets its scatter drop them; placing
    # them after the routed ones keeps every index in range (ONNX ScatterND has no drop mode)
    dest = jnp.where(routed, jnp.cumsum(r, axis=1) - 1, count + jnp.cumsum(1 - r, axis=1) - 1)
    cores = lax.broadcasted_iota(jnp.int32, routed.shape, 0)
    tokens = lax.broadcasted_iota(jnp.int32, routed.shape, 1)
    order = jnp.zeros_like(tokens).at[cores, dest].set(tokens, mode="promise_in_bounds")
    return order, count


def nsp(x, gate_up, down, weights, index, *, num_nsp, packed_chunk):
    """QEffPrefillChunkedGemma4TextExperts: experts split over num_nsp cores; per core and local
    expert, its routed tokens packed to the front, the MLP over every packed_chunk-row chunk
    (static shapes: exact for any routing), rows past the routed count left as they were,
    results scattered back to their tokens, summed over cores.

    x: [T, D]; gate_up: [E, 2I, D]; down: [E, D, I]; weights, index: [T, K] → [T, D].
    """
    t, d = x.shape
    e = gate_up.shape[0]
    MoeMode("nsp", num_nsp, packed_chunk).check(e, t)
    acc = _accumulator(x)
    hot = _onehot(index, e, jnp.int32)  # [T, K, E]
    # routed from the picks, not from weight > 0 as QEfficient: per_expert_scale may be ≤ 0
    routed = jnp.transpose(jnp.sum(hot, axis=1) > 0)  # [E, T]
    rw = jnp.transpose(combine(weights, index, e))  # [E, T]
    out = jnp.zeros((num_nsp, t, d), acc)
    cores = lax.broadcasted_iota(jnp.int32, (num_nsp, packed_chunk), 0)
    rows = lax.broadcasted_iota(jnp.int32, (1, packed_chunk), 1)
    for slot in range(e // num_nsp):
        gu = jnp.swapaxes(slot_experts(gate_up, slot, num_nsp), 1, 2).astype(x.dtype)  # [C, D, 2I]
        dn = jnp.swapaxes(slot_experts(down, slot, num_nsp), 1, 2).astype(x.dtype)  # [C, I, D]
        slot_weights = slot_experts(rw, slot, num_nsp)  # [C, T]
        order, count = pack(slot_experts(routed, slot, num_nsp))
        for start in range(0, t, packed_chunk):
            tok = order[:, start : start + packed_chunk]  # [C, P]
            h = jnp.matmul(x[tok], gu)  # [C, P, 2I]
            gate, up = jnp.split(h, 2, axis=-1)
            y = jnp.matmul(gelu_tanh(gate) * up, dn).astype(acc)  # [C, P, D]
            w = jnp.take_along_axis(slot_weights, tok, axis=1)[:, :, None]  # [C, P, 1]
            prior = out[cores, tok]  # [C, P, D]
            # rows past the routed count hold unrouted tokens: they keep what they had
            keep = (start + rows < count)[:, :, None]
            new = jnp.where(keep, prior + y * w, prior)
            out = out.at[cores, tok].set(new, mode="promise_in_bounds")
    return jnp.sum(out, axis=0).astype(x.dtype)


def run(mode, x, gate_up, down, weights, index):
    """The experts in `mode` (a `ref.moe_modes.MoeMode`, its text, or None: dense); the
    arguments and result of `dense`."""
    mode = parse(mode)
    if mode.name == "gather":
        return gather(x, gate_up, down, weights, index)
    if mode.name == "nsp":
        return nsp(x, gate_up, down, weights, index, num_nsp=mode.num_nsp,
                   packed_chunk=mode.packed_chunk)  # fmt: skip
    return dense(x, gate_up, down, weights, index)


class Router(nn.Module):
    """Gemma4TextRouter: `proj.weight`, `scale`, `per_expert_scale`. x: [N, D] → (weights
    [N, K], index [N, K])."""

    config: TextConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        proj = Weight((c.num_experts, c.hidden_size), name="proj")()
        scale = self.param("scale", nn.initializers.ones, (c.hidden_size,))
        per_expert = self.param("per_expert_scale", nn.initializers.ones, (c.num_experts,))
        return route(x, proj, scale, per_expert, c.top_k_experts, c.rms_norm_eps)


class Experts(nn.Module):
    """Gemma4TextExperts: `gate_up_proj` [E, 2I, D], `down_proj` [E, D, I], run in `mode`.
    (x [N, D], weights, index [N, K]) → [N, D]."""

    config: TextConfig
    mode: MoeMode = MoeMode()

    @nn.compact
    def __call__(self, x, weights, index):
        c = self.config
        e, inter, d = c.num_experts, c.moe_intermediate_size, c.hidden_size
        init = nn.initializers.normal(0.02)
        gate_up = self.param("gate_up_proj", init, (e, 2 * inter, d))
        down = self.param("down_proj", init, (e, d, inter))
        return run(self.mode, x, gate_up, down, weights, index)
