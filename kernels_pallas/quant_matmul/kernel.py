"""Pallas quantized matmuls: int8 x int8 (prefill, W8A8) and int4-weight x float activation
with the dequantization inside the kernel (decode, W4A16). Layouts: reference.py.

Two backends per op, chosen explicitly (never guessed from the platform):

* "mosaic_tpu": grid (m_tiles, n_tiles, k_tiles) with BlockSpecs and a VMEM accumulator
  over k (int32 for int8 x int8, f32 for the int4 kernel); the scales are applied once at
  the last k step (int8) or to each dequantized weight tile (int4).
* "triton": grid (m_tiles, n_tiles); each program loops over k with plain loads.

int4 kernel: the activation's columns are split outside the kernel into the rows the low
and the high nibbles hold (x_lo, x_hi [M, K/2], see reference.py), so a block of packed
rows [bk2, bn] is unpacked with two bit operations, its group scales / zero points
[bk2 / (G/2), bn] are broadcast over their G/2 rows, and the block contributes
x_lo @ w_lo + x_hi @ w_hi. Only one [bk2, bn] tile is ever dequantized (in VMEM /
registers): the whole float weight is never written to HBM.

M, K and N are padded with zeros (exact: zero codes meet zero scales or zero
activations) and the result sliced.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.quant_matmul.reference import SYMMETRIC_ZERO
from kernels_pallas.tiling import TileSizes, round_up

BACKENDS = ("mosaic_tpu", "triton")
_NN = (((1,), (0,)), ((), ()))


@dataclasses.dataclass(frozen=True)
class BlockSizes(TileSizes):
    """Tile sizes: rows (bm), contraction (bk, unpacked rows of K), output columns (bn)."""

    bm: int = 128
    bk: int = 512
    bn: int = 256


def _pow2_at_least(x: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, (x - 1).bit_length()))


def _pad(x, shape):
    return jnp.pad(x, [(0, s - d) for s, d in zip(shape, x.shape)])


def _lane_block(block: int, dim: int, strict: bool) -> int:
    """Mosaic: the whole dim, or a multiple of 128 (8 in interpret mode) that is <= dim."""
    if dim <= block:
        return dim
    return max(128 if strict else 8, block - block % (128 if strict else 8))


# ------------------------------------------------------------------------- int8 x int8

def _int8_tpu_kernel(xq_ref, xs_ref, wq_ref, ws_ref, out_ref, acc_ref, *, k_tiles):
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jax.lax.dot_general(xq_ref[...], wq_ref[...], _NN,
                                        preferred_element_type=jnp.int32)

    @pl.when(k == k_tiles - 1)
    def _write():
        out_ref[...] = (acc_ref[...].astype(jnp.float32) * xs_ref[...] * ws_ref[...]
                        ).astype(out_ref.dtype)


def _int8_triton_kernel(xq_ref, xs_ref, wq_ref, ws_ref, out_ref, *, bm, bk, bn, k_tiles):
    i, j = pl.program_id(0), pl.program_id(1)
    rows, cols = pl.ds(i * bm, bm), pl.ds(j * bn, bn)

    def body(k, acc):
        a = xq_ref[rows, pl.ds(k * bk, bk)]
        b = wq_ref[pl.ds(k * bk, bk), cols]
        return acc + jax.lax.dot_general(a, b, _NN, preferred_element_type=jnp.int32)

    acc = jax.lax.fori_loop(0, k_tiles, body, jnp.zeros((bm, bn), jnp.int32))
    out = acc.astype(jnp.float32) * xs_ref[rows, :] * ws_ref[:, cols]
    out_ref[rows, cols] = out.astype(out_ref.dtype)


def int8_matmul(xq, x_scale, wq, w_scale, *, block_sizes: BlockSizes = BlockSizes(),
                backend: str = "mosaic_tpu", interpret: bool = False):
    """[M, K] int8 x [K, N] int8 -> f32 [M, N] with per-row / per-column scales."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    m, kdim = xq.shape
    n = wq.shape[1]
    strict = not interpret
    if backend == "triton":
        bm = _pow2_at_least(min(block_sizes.bm, m))
        bk = _pow2_at_least(min(block_sizes.bk, kdim), 32)
        bn = _pow2_at_least(min(block_sizes.bn, n))
    else:
        bm = min(round_up(block_sizes.bm, 32), round_up(m, 32))  # int8 sublane tile: 32
        bk = _lane_block(block_sizes.bk, kdim, strict)
        bn = _lane_block(block_sizes.bn, n, strict)
    mp, kp, np_ = round_up(m, bm), round_up(kdim, bk), round_up(n, bn)
    xq_p, wq_p = _pad(xq, (mp, kp)), _pad(wq, (kp, np_))
    xs_p = _pad(x_scale.astype(jnp.float32), (mp, 1))
    ws_p = _pad(w_scale.astype(jnp.float32), (1, np_))
    out_shape = jax.ShapeDtypeStruct((mp, np_), jnp.float32)
    if backend == "triton":
        kernel = functools.partial(_int8_triton_kernel, bm=bm, bk=bk, bn=bn,
                                   k_tiles=kp // bk)
        out = pl.pallas_call(kernel, out_shape=out_shape, grid=(mp // bm, np_ // bn),
                             compiler_params=pltriton.CompilerParams(num_warps=4,
                                                                     num_stages=2),
                             interpret=interpret, name="int8_matmul_triton")(
            xq_p, xs_p, wq_p, ws_p)
    else:
        kernel = functools.partial(_int8_tpu_kernel, k_tiles=kp // bk)
        out = pl.pallas_call(
            kernel, out_shape=out_shape, grid=(mp // bm, np_ // bn, kp // bk),
            in_specs=[pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)),
                      pl.BlockSpec((bm, 1), lambda i, j, k: (i, 0)),
                      pl.BlockSpec((bk, bn), lambda i, j, k: (k, j)),
                      pl.BlockSpec((1, bn), lambda i, j, k: (0, j))],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.int32)],
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "arbitrary")),
            interpret=interpret, name="int8_matmul_mosaic")(xq_p, xs_p, wq_p, ws_p)
    return out[:m, :n]


# ------------------------------------------------------------- int4 weight x float act

def _dequant_tile(packed, scale, zero, half: int, dtype):
    """packed [bk2, bn] uint8, scale/zero [ng, bn] -> (w_lo, w_hi) [bk2, bn] in dtype."""
    bk2, bn = packed.shape
    ng = bk2 // half
    u = packed.astype(jnp.int32)
    expand = lambda a: jnp.broadcast_to(a[:, None, :], (ng, half, bn)).reshape(bk2, bn)  # noqa: E731
    s = expand(scale.astype(jnp.float32))
    z = jnp.float32(SYMMETRIC_ZERO) if zero is None else expand(zero.astype(jnp.float32))
    w_lo = ((u & 15).astype(jnp.float32) - z) * s
    w_hi = ((u >> 4).astype(jnp.float32) - z) * s
    return w_lo.astype(dtype), w_hi.astype(dtype)


def _int4_tpu_kernel(xlo_ref, xhi_ref, p_ref, s_ref, *rest, half, k_tiles, has_zero):
    if has_zero:
        z_ref, out_ref, acc_ref = rest
        zero = z_ref[...]
    else:
        (out_ref, acc_ref), zero = rest, None
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x_lo, x_hi = xlo_ref[...], xhi_ref[...]
    w_lo, w_hi = _dequant_tile(p_ref[...], s_ref[...], zero, half, x_lo.dtype)
    acc_ref[...] += (jax.lax.dot_general(x_lo, w_lo, _NN, preferred_element_type=jnp.float32)
                     + jax.lax.dot_general(x_hi, w_hi, _NN,
                                           preferred_element_type=jnp.float32))

    @pl.when(k == k_tiles - 1)
    def _write():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _int4_triton_kernel(xlo_ref, xhi_ref, p_ref, s_ref, *rest, bm, bk2, bn, half, k_tiles,
                        has_zero):
    if has_zero:
        z_ref, out_ref = rest
    else:
        (out_ref,), z_ref = rest, None
    i, j = pl.program_id(0), pl.program_id(1)
    rows, cols = pl.ds(i * bm, bm), pl.ds(j * bn, bn)
    ng = bk2 // half

    def body(k, acc):
        x_lo = xlo_ref[rows, pl.ds(k * bk2, bk2)]
        x_hi = xhi_ref[rows, pl.ds(k * bk2, bk2)]
        groups = pl.ds(k * ng, ng)
        zero = None if z_ref is None else z_ref[groups, cols]
        w_lo, w_hi = _dequant_tile(p_ref[pl.ds(k * bk2, bk2), cols], s_ref[groups, cols],
                                   zero, half, x_lo.dtype)
        return (acc + jax.lax.dot_general(x_lo, w_lo, _NN, preferred_element_type=jnp.float32)
                + jax.lax.dot_general(x_hi, w_hi, _NN, preferred_element_type=jnp.float32))

    acc = jax.lax.fori_loop(0, k_tiles, body, jnp.zeros((bm, bn), jnp.float32))
    out_ref[rows, cols] = acc.astype(out_ref.dtype)


def split_activation(x, group_size: int):
    """x [M, K] -> (x_lo, x_hi) [M, K/2]: the columns the low / high nibbles multiply."""
    m, k = x.shape
    xg = x.reshape(m, k // group_size, 2, group_size // 2)
    return xg[:, :, 0].reshape(m, k // 2), xg[:, :, 1].reshape(m, k // 2)


def int4_matmul(x, packed, scale, zero, *, group_size: int,
                block_sizes: BlockSizes = BlockSizes(), backend: str = "mosaic_tpu",
                interpret: bool = False):
    """x [M, K] (float) @ int4 weight (packed [K/2, N] uint8, scale/zero [K/G, N]) -> [M, N]
    in x's dtype, dequantizing one tile at a time inside the kernel."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    m, kdim = x.shape
    n = packed.shape[1]
    half = group_size // 2
    k2 = kdim // 2
    if backend == "triton":
        bm = _pow2_at_least(min(block_sizes.bm, m))
        bk2 = max(64, half)  # a power of two, a whole number of groups, >= 16 for tl.dot
        bn = _pow2_at_least(min(block_sizes.bn, n))
    else:
        bm = min(round_up(block_sizes.bm, 8), round_up(m, 8))
        # 8 groups per block: the scale block's sublane dim is 8 (or the whole K/G)
        bk2 = k2 if k2 <= 8 * half else 8 * half
        if interpret:
            bk2 = min(bk2, max(half, (block_sizes.bk // 2) // half * half))
        bn = _lane_block(block_sizes.bn, n, not interpret)
    mp, k2p, np_ = round_up(m, bm), round_up(k2, bk2), round_up(n, bn)
    ng, ngp = k2 // half, k2p // half
    x_lo, x_hi = split_activation(x, group_size)
    x_lo, x_hi = _pad(x_lo, (mp, k2p)), _pad(x_hi, (mp, k2p))
    args = [x_lo, x_hi, _pad(packed, (k2p, np_)), _pad(scale, (ngp, np_))]
    has_zero = zero is not None
    if has_zero:
        args.append(_pad(zero, (ngp, np_)))
    out_shape = jax.ShapeDtypeStruct((mp, np_), x.dtype)
    k_tiles = k2p // bk2
    if backend == "triton":
        kernel = functools.partial(_int4_triton_kernel, bm=bm, bk2=bk2, bn=bn, half=half,
                                   k_tiles=k_tiles, has_zero=has_zero)
        out = pl.pallas_call(kernel, out_shape=out_shape, grid=(mp // bm, np_ // bn),
                             compiler_params=pltriton.CompilerParams(num_warps=4,
                                                                     num_stages=2),
                             interpret=interpret, name="int4_matmul_triton")(*args)
    else:
        nb = bk2 // half
        specs = [pl.BlockSpec((bm, bk2), lambda i, j, k: (i, k)),
                 pl.BlockSpec((bm, bk2), lambda i, j, k: (i, k)),
                 pl.BlockSpec((bk2, bn), lambda i, j, k: (k, j)),
                 pl.BlockSpec((nb, bn), lambda i, j, k: (k, j))]
        if has_zero:
            specs.append(pl.BlockSpec((nb, bn), lambda i, j, k: (k, j)))
        kernel = functools.partial(_int4_tpu_kernel, half=half, k_tiles=k_tiles,
                                   has_zero=has_zero)
        out = pl.pallas_call(
            kernel, out_shape=out_shape, grid=(mp // bm, np_ // bn, k_tiles),
            in_specs=specs, out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "arbitrary")),
            interpret=interpret, name="int4_matmul_mosaic")(*args)
    del ng
    return out[:m, :n]
