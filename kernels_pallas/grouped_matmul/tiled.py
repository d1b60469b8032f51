"""The kernels' tile-visit algorithm in plain JAX (implementation "xla_tiled").

Why it exists: XLA:CPU lowers jax.lax.ragged_dot to a dense matmul per group under a mask,
so its cost is G times the useful work. Walking the same visit schedule as the Pallas
kernels (metadata.py) with a loop of [bm, K] x [K, N] matmuls costs (M + G * bm) rows,
which makes MoE training and expert-parallel layers practical on CPU. It also checks the
visit metadata independently of Pallas.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels_pallas.grouped_matmul import metadata


def _vary_like(x: Array, *refs: Array) -> Array:
    """Give a fresh constant the shard_map varying axes of `refs` (no-op outside one), so
    loop carries and cond branches type-check under shard_map's vma checking."""
    vma = lambda a: set(jax.typeof(a).mat.varying)  # noqa: E731
    axes = set().union(*map(vma, refs)) - vma(x)
    return jax.lax.pcast(x, tuple(sorted(axes)), to="varying") if axes else x


def _pad_rows(x: Array, m_padded: int) -> Array:
    return jnp.pad(x, ((0, m_padded - x.shape[0]), (0, 0)))


def gmm_tiled(lhs: Float[Array, "M K"], rhs: Float[Array, "G K N"],
              group_sizes: Int[Array, "G"], *, bm: int = 64,
              transpose_rhs: bool = False) -> Array:
    """out[m] = lhs[m] @ rhs[group(m)] (rhs [G, N, K] when transpose_rhs); [M, N]."""
    m, k = lhs.shape
    n_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    m_padded = -(-m // bm) * bm
    lhs_p = _pad_rows(lhs, m_padded)
    visits = metadata.gmm_visits(group_sizes, m, m_padded, bm)
    contract = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))

    def body(v, out):
        seg, row0 = visits.segment[v], visits.tile[v] * bm
        w = rhs[jnp.minimum(seg, n_groups - 1)]
        tile = jax.lax.dynamic_slice(lhs_p, (row0, 0), (bm, k))
        y = jax.lax.cond(
            (seg < n_groups) & (visits.valid[v] > 0),
            lambda: jax.lax.dot_general(tile, w, contract,
                                        preferred_element_type=jnp.float32),
            lambda: _vary_like(jnp.zeros((bm, n), jnp.float32), lhs, rhs, group_sizes))
        current = jax.lax.dynamic_slice(out, (row0, 0), (bm, n))
        mask = metadata.row_mask(visits, v, bm)[:, None]
        return jax.lax.dynamic_update_slice(out, jnp.where(mask, y, current), (row0, 0))

    out = _vary_like(jnp.zeros((m_padded, n), jnp.float32), lhs, rhs, group_sizes)
    out = jax.lax.fori_loop(0, visits.segment.shape[0], body, out)
    return out[:m].astype(lhs.dtype)


def tgmm_tiled(lhs: Float[Array, "M K"], dout: Float[Array, "M N"],
               group_sizes: Int[Array, "G"], *, bm: int = 64) -> Array:
    """out[g] = lhs[rows of g].T @ dout[rows of g]; [G, K, N]."""
    m, k = lhs.shape
    n = dout.shape[1]
    n_groups = group_sizes.shape[0]
    m_padded = -(-m // bm) * bm
    lhs_p, dout_p = _pad_rows(lhs, m_padded), _pad_rows(dout, m_padded)
    visits = metadata.tgmm_visits(group_sizes, m, m_padded, bm)

    def body(v, out):
        seg, row0 = visits.segment[v], visits.tile[v] * bm
        mask = metadata.row_mask(visits, v, bm)[:, None]
        a = jnp.where(mask, jax.lax.dynamic_slice(lhs_p, (row0, 0), (bm, k)), 0)
        d = jax.lax.dynamic_slice(dout_p, (row0, 0), (bm, n))
        add = jax.lax.cond(
            jnp.any(mask),
            lambda: jax.lax.dot_general(a, d, (((0,), (0,)), ((), ())),
                                        preferred_element_type=jnp.float32),
            lambda: _vary_like(jnp.zeros((k, n), jnp.float32), lhs, dout, group_sizes))
        return out.at[seg].add(add)

    out = _vary_like(jnp.zeros((n_groups, k, n), jnp.float32), lhs, dout, group_sizes)
    out = jax.lax.fori_loop(0, visits.segment.shape[0], body, out)
    return out.astype(lhs.dtype)
