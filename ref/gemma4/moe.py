"""Gemma 4's mixture of experts (the 26B-A4B text model): the router and the experts as pure
functions, and the Linen modules with the checkpoint's names (`router.*`, `experts.*`).

Every expert runs on every token and the router's combine weights are zero outside each
token's top-k: dense, static shapes, what an exported graph needs.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from ref.gemma4.text_config import TextConfig
from ref.layers import Weight, gelu_tanh, linear, rms_norm


def route(x, proj, scale, per_expert_scale, top_k, eps):
    """Gemma4TextRouter as dense combine weights.

    x: [N, D]; proj: [E, D]; scale: [D]; per_expert_scale: [E] → [N, E] float32, zero outside
    each token's top-k experts, the top-k renormalized to sum 1, then scaled per expert.
    """
    h = rms_norm(x, None, eps) * scale.astype(x.dtype) * (x.shape[-1] ** -0.5)
    probs = jax.nn.softmax(linear(h, proj).astype(jnp.float32), axis=-1)
    weights, index = jax.lax.top_k(probs, top_k)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights * per_expert_scale.astype(jnp.float32)[index]
    # a comparison, not jax.nn.one_hot: that exports as ONNX OneHot, outside QAIC's op set
    experts = lax.broadcasted_iota(index.dtype, (1, 1, proj.shape[0]), 2)
    onehot = (index[:, :, None] == experts).astype(jnp.float32)  # [N, K, E]
    return jnp.sum(onehot * weights[:, :, None], axis=1)


def experts(x, gate_up, down, combine):
    """Every expert's gated MLP, mixed by the router's weights (zero for unrouted experts).

    x: [N, D]; gate_up: [E, 2I, D]; down: [E, D, I]; combine: [N, E] → [N, D].
    """
    h = jnp.matmul(x[None], jnp.swapaxes(gate_up, 1, 2).astype(x.dtype))  # [E, N, 2I]
    gate, up = jnp.split(h, 2, axis=-1)
    y = jnp.matmul(gelu_tanh(gate) * up, jnp.swapaxes(down, 1, 2).astype(x.dtype))  # [E, N, D]
    mixed = jnp.sum(y * jnp.transpose(combine)[:, :, None], axis=0)
    return mixed.astype(x.dtype)


class Router(nn.Module):
    """Gemma4TextRouter: `proj.weight`, `scale`, `per_expert_scale`. x: [N, D] → [N, E]."""

    config: TextConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        proj = Weight((c.num_experts, c.hidden_size), name="proj")()
        scale = self.param("scale", nn.initializers.ones, (c.hidden_size,))
        per_expert = self.param("per_expert_scale", nn.initializers.ones, (c.num_experts,))
        return route(x, proj, scale, per_expert, c.top_k_experts, c.rms_norm_eps)


class Experts(nn.Module):
    """Gemma4TextExperts: `gate_up_proj` [E, 2I, D], `down_proj` [E, D, I]."""

    config: TextConfig

    @nn.compact
    def __call__(self, x, combine):
        c = self.config
        e, inter, d = c.num_experts, c.moe_intermediate_size, c.hidden_size
        init = nn.initializers.normal(0.02)
        gate_up = self.param("gate_up_proj", init, (e, 2 * inter, d))
        down = self.param("down_proj", init, (e, d, inter))
        return experts(x, gate_up, down, combine)
