"""Plain-JAX references for grouped matmuls (the "xla" implementation and the oracle).

Rows of `lhs` are sorted by group: rows [offsets[g], offsets[g] + group_sizes[g]) belong to
group g, offsets = exclusive cumsum of group_sizes. Rows past sum(group_sizes) belong to no
group: gmm writes zeros there and tgmm ignores them.

    gmm:  out[m] = lhs[m] @ rhs[group(m)]                    [M, K] x [G, K, N] -> [M, N]
    tgmm: out[g] = lhs[rows of g].T @ dout[rows of g]        [M, K] x [M, N]    -> [G, K, N]

tgmm is the weight gradient of gmm (and gmm with a transposed rhs its input gradient).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

_TGMM_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


def gmm_reference(lhs: Float[Array, "M K"], rhs: Float[Array, "G K N"],
                  group_sizes: Int[Array, "G"], transpose_rhs: bool = False) -> Array:
    """Grouped matmul via jax.lax.ragged_dot (rhs is [G, N, K] when transpose_rhs)."""
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                             preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


def tgmm_reference(lhs: Float[Array, "M K"], dout: Float[Array, "M N"],
                   group_sizes: Int[Array, "G"]) -> Array:
    """Per-group lhs.T @ dout via jax.lax.ragged_dot_general (ragged contracting dim)."""
    out = jax.lax.ragged_dot_general(lhs, dout, group_sizes.astype(jnp.int32), _TGMM_DIMS,
                                     preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


def group_ids(group_sizes: Int[Array, "G"], m: int) -> Int[Array, "M"]:
    """Group of each of m sorted rows; G (no group) for rows past sum(group_sizes)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right").astype(
        jnp.int32)


def gmm_masked(lhs: Float[Array, "M K"], rhs: Float[Array, "G K N"],
               group_sizes: Int[Array, "G"]) -> Array:
    """An independent dense oracle: one-hot group mask, O(M*G*K*N). Tests only."""
    onehot = jax.nn.one_hot(group_ids(group_sizes, lhs.shape[0]), rhs.shape[0],
                            dtype=jnp.float32)
    out = jnp.einsum("mk,mg,gkn->mn", lhs.astype(jnp.float32), onehot,
                     rhs.astype(jnp.float32), precision="highest")
    return out.astype(lhs.dtype)


def tgmm_masked(lhs: Float[Array, "M K"], dout: Float[Array, "M N"],
                group_sizes: Int[Array, "G"]) -> Array:
    """An independent dense oracle for tgmm. Tests only."""
    onehot = jax.nn.one_hot(group_ids(group_sizes, lhs.shape[0]), group_sizes.shape[0],
                            dtype=jnp.float32)
    out = jnp.einsum("mk,mg,mn->gkn", lhs.astype(jnp.float32), onehot,
                     dout.astype(jnp.float32), precision="highest")
    return out.astype(lhs.dtype)
