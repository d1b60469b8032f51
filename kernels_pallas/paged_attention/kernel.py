"""Pallas paged decode attention kernels (online softmax over KV blocks).

Two grids, one per backend, sharing the online-softmax update `_online_softmax_step`:

- TPU (Mosaic): grid (B, Hkv, M). The block table and lengths are scalar-prefetched; the
  K/V BlockSpec index_map reads `table[b, p]`, so the pipeline streams exactly the blocks
  of row b (one (block_size, D) tile per step) and blocks past the row's length are
  skipped with `pl.when`. The G = Hq/Hkv query heads of a KV head share each tile.
- GPU (Triton): grid (B, Hq). Triton has no scalar prefetch, so each program loops over
  its row's blocks and loads the tile of `table[b, p]` with a dynamic index. Triton
  needs power-of-two tiles: block_size and D must be powers of two.

Both take the pools in the [Hkv, N, block_size, D] layout of `research.kv.paged`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

MASK = -1e30  # finite: keeps exp(m_old - m_new) well defined while a row is all-masked


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tuning knobs. The KV tile is one cache block; Triton launch parameters."""

    num_warps: int = 4
    num_stages: int = 2


def _online_softmax_step(q, k, v, valid, m, l, acc, *, use_dot: bool):
    """One KV tile: q [G, D] (pre-scaled), k/v [S, D], valid [S] -> updated (m, l, acc).

    use_dot: MXU matmuls (TPU); otherwise broadcast-multiply-reduce, which Triton
    accepts for any power-of-two tile (tl.dot needs every dimension >= 16).
    """
    if use_dot:
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)  # [G, S]
    else:
        s = jnp.sum(q[:, None, :] * k[None, :, :], axis=2)
    s = jnp.where(valid[None, :], s, MASK)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(valid[None, :], jnp.exp(s - m_new), 0.0)
    corr = jnp.exp(m - m_new)
    l_new = l * corr + jnp.sum(p, axis=1, keepdims=True)
    if use_dot:
        pv = jax.lax.dot_general(p, v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
    else:
        pv = jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, l_new, acc * corr + pv


def _valid_positions(start, size: int, length, window: int | None):
    pos = start + jax.lax.broadcasted_iota(jnp.int32, (size,), 0)
    valid = pos < length
    if window is not None:
        valid &= pos > length - 1 - window
    return valid


# -- TPU ---------------------------------------------------------------------------------
def _tpu_kernel(table_ref, len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *,
                block_size: int, window: int | None, scale: float):
    b, p = pl.program_id(0), pl.program_id(2)
    length = len_ref[b]
    start = p * block_size

    @pl.when(p == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    live = start < length
    if window is not None:
        live &= start + block_size > length - window

    @pl.when(live)
    def _step():
        q = q_ref[...].astype(jnp.float32) * scale
        valid = _valid_positions(start, block_size, length, window)
        m, l, acc = _online_softmax_step(q, k_ref[...].astype(jnp.float32),
                                         v_ref[...].astype(jnp.float32), valid,
                                         m_ref[...], l_ref[...], acc_ref[...], use_dot=True)
        m_ref[...], l_ref[...], acc_ref[...] = m, l, acc

    @pl.when(p == pl.num_programs(2) - 1)
    def _out():
        l = l_ref[...]
        o_ref[...] = jnp.where(l > 0, acc_ref[...] / jnp.where(l > 0, l, 1.0),
                               0.0).astype(o_ref.dtype)


def paged_decode_attention_tpu(q, k_pool, v_pool, block_table, lengths, *, window, interpret,
                               block_sizes: BlockSizes = BlockSizes()):
    """q [B, Hq, D] -> [B, Hq, D]; Mosaic TPU kernel (or its interpretation on CPU)."""
    del block_sizes
    b, hq, d = q.shape
    hkv, _, s, _ = k_pool.shape
    g, m = hq // hkv, block_table.shape[1]
    q4 = q.reshape(b, hkv, g, d)
    table = jnp.maximum(block_table, 0).astype(jnp.int32)  # unmapped -> block 0, masked
    kv_spec = pl.BlockSpec((None, None, s, d), lambda bi, h, p, tbl, lens: (h, tbl[bi, p], 0, 0))
    q_spec = pl.BlockSpec((None, None, g, d), lambda bi, h, p, tbl, lens: (bi, h, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(b, hkv, m), in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((g, 1), jnp.float32), pltpu.VMEM((g, 1), jnp.float32),
                        pltpu.VMEM((g, d), jnp.float32)])
    kernel = functools.partial(_tpu_kernel, block_size=s, window=window, scale=d ** -0.5)
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype), grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret, name="paged_decode_attention_tpu",
    )(table, lengths.astype(jnp.int32), q4, k_pool, v_pool)
    return out.reshape(b, hq, d)


# -- GPU (Triton) ------------------------------------------------------------------------
def _gpu_kernel(table_ref, len_ref, q_ref, k_ref, v_ref, o_ref, *, block_size: int,
                n_blocks: int, group: int, window: int | None, scale: float):
    h = pl.program_id(1)
    kvh = h // group
    length = len_ref[0]
    q = q_ref[...].astype(jnp.float32)[None, :] * scale  # [1, D]
    d = q.shape[1]

    def body(p, carry):
        m, l, acc = carry
        page = table_ref[p]
        k = k_ref[kvh, page, pl.ds(0, block_size), pl.ds(0, d)].astype(jnp.float32)
        v = v_ref[kvh, page, pl.ds(0, block_size), pl.ds(0, d)].astype(jnp.float32)
        valid = _valid_positions(p * block_size, block_size, length, window)
        return _online_softmax_step(q, k, v, valid, m, l, acc, use_dot=False)

    init = (jnp.full((1, 1), MASK, jnp.float32), jnp.zeros((1, 1), jnp.float32),
            jnp.zeros((1, d), jnp.float32))
    # only the blocks holding positions [length - window, length) are visited
    last = jnp.minimum((length + block_size - 1) // block_size, n_blocks)
    first = 0 if window is None else jnp.maximum(length - window, 0) // block_size
    m, l, acc = jax.lax.fori_loop(first, last, body, init)
    out = jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)
    o_ref[...] = out[0].astype(o_ref.dtype)


def paged_decode_attention_gpu(q, k_pool, v_pool, block_table, lengths, *, window, interpret,
                               block_sizes: BlockSizes = BlockSizes()):
    """q [B, Hq, D] -> [B, Hq, D]; Triton kernel (or its interpretation on CPU)."""
    b, hq, d = q.shape
    hkv, _, s, _ = k_pool.shape
    m = block_table.shape[1]
    m_pad = pl.next_power_of_2(m)
    table = jnp.zeros((b, m_pad), jnp.int32).at[:, :m].set(jnp.maximum(block_table, 0))
    lengths2 = lengths.astype(jnp.int32)[:, None]
    kernel = functools.partial(_gpu_kernel, block_size=s, n_blocks=m, group=hq // hkv,
                               window=window, scale=d ** -0.5)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(b, hq),
        in_specs=[pl.BlockSpec((None, m_pad), lambda bi, h: (bi, 0)),
                  pl.BlockSpec((None, 1), lambda bi, h: (bi, 0)),
                  pl.BlockSpec((None, None, d), lambda bi, h: (bi, h, 0)),
                  pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((None, None, d), lambda bi, h: (bi, h, 0)),
        compiler_params=pltriton.CompilerParams(num_warps=block_sizes.num_warps,
                                                num_stages=block_sizes.num_stages),
        interpret=interpret, name="paged_decode_attention_gpu",
    )(table, lengths2, q, k_pool, v_pool)
