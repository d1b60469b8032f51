"""Pure building blocks of a Llama decoder: RMSNorm, SwiGLU and a routed MoE FFN (RoPE lives
in research.core.rope so KV codecs can use it without depending on the model)."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels_pallas.grouped_matmul import GroupedMatmul
from research.core.rope import apply_rope, rope_angles  # noqa: F401  (re-exported)

# the MoE FFN's grouped matmul: implementation "auto" = XLA ragged_dot on CPU, the Pallas
# kernel on TPU (Mosaic) and CUDA, picked per lowering platform (kernels_pallas.dispatch)
GROUPED_MATMUL = GroupedMatmul()


def rms_norm(x: Float[Array, "... D"], weight: Float[Array, "D"], eps: float) -> Array:
    """RMSNorm computed in f32, returned in the input dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


class LinearWeight:
    """Base of weight types that run their own linear op (quantized weights,
    `research.dynacore`). The model calls `linear(x, w)` for every projection (q/k/v/o,
    gate/up/down, an untied LM head); a plain array is `x @ w`, a LinearWeight runs
    `w.linear(x)`. This is the one place the model dispatches on the weight type.

    Subclasses implement `linear(x [..., K]) -> [..., N]` in x's dtype, and may implement
    `for_phase(phase)`: the weight that serves "prefill" or "decode" (a weight holding one
    set per phase selects it; every other weight returns itself). `Model.for_phase` maps
    it over the params."""

    def linear(self, x: Array) -> Array:
        raise NotImplementedError

    def for_phase(self, phase: str) -> "LinearWeight":
        return self


def linear(x: Float[Array, "... K"], w) -> Array:
    """x @ w for a plain [K, N] weight, `w.linear(x)` for a LinearWeight."""
    if isinstance(w, LinearWeight):
        return w.linear(x)
    return x @ w


def swiglu(x: Float[Array, "... D"], w_gate, w_up, w_down) -> Array:
    return linear(jax.nn.silu(linear(x, w_gate)) * linear(x, w_up), w_down)


class Routing(NamedTuple):
    """What the router decided for N tokens (kept for load statistics and MoE research)."""

    logits: Float[Array, "N E"]
    expert_ids: Int[Array, "N K"]
    weights: Float[Array, "N K"]


def route(x: Float[Array, "N D"], router: Float[Array, "D E"], top_k: int,
          renormalize: bool) -> Routing:
    logits = (x @ router).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, expert_ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(logits, expert_ids, weights)


def sort_by_expert(expert_ids: Int[Array, "N K"], n_experts: int):
    """Order of the N*K (token, slot) assignments grouped by expert, and group sizes."""
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    return order, group_sizes


def expert_ffn(x_sorted: Float[Array, "M D"], group_sizes: Int[Array, "E"], w_gate: Array,
               w_up: Array, w_down: Array, matmul=GROUPED_MATMUL) -> Array:
    """SwiGLU of expert-sorted rows with ragged (dropless) group sizes.

    matmul: grouped matmul (lhs [M, K], rhs [E, K, N], group_sizes [E]) -> [M, N]; by
      default kernels_pallas' platform dispatch: jax.lax.ragged_dot on CPU, the Pallas
      kernel on TPU and CUDA (chosen when the step is lowered).
    """
    gate = matmul(x_sorted, w_gate, group_sizes)
    up = matmul(x_sorted, w_up, group_sizes)
    return matmul(jax.nn.silu(gate) * up, w_down, group_sizes)


def moe_ffn(x: Float[Array, "N D"], p: dict, top_k: int, renormalize: bool,
            matmul=GROUPED_MATMUL):
    """Dropless top-k MoE FFN. Returns (y [N, D], Routing)."""
    n_experts = p["router"].shape[-1]
    routing = route(x, p["router"], top_k, renormalize)
    order, group_sizes = sort_by_expert(routing.expert_ids, n_experts)
    token_of = order // top_k
    y_sorted = expert_ffn(x[token_of], group_sizes, p["w_gate"], p["w_up"], p["w_down"],
                          matmul)
    w_sorted = routing.weights.reshape(-1)[order].astype(y_sorted.dtype)
    y = jnp.zeros_like(x).at[token_of].add(y_sorted * w_sorted[:, None])
    return y, routing
