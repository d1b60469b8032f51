"""Pallas grouped matmul (gmm) and transposed grouped matmul (tgmm) kernels.

Two backends, chosen explicitly (never guessed from the platform):

* "mosaic_tpu": blocked kernels in the style of megablox. Grid (n_tiles, visits, k_tiles)
  for gmm and (k_tiles, n_tiles, visits) for tgmm; the visit schedule (metadata.py) is
  scalar-prefetched so the BlockSpec index maps pick each visit's row tile and group, and an
  f32 VMEM accumulator runs over k. Consecutive visits of one output block keep it
  resident, so each visit writes only its own rows (row mask) without races.
* "triton": pointer-style kernels for GPUs. gmm has grid (visits, n_tiles); each program
  loops over k with plain loads and stores its rows with a masked store (different
  programs own disjoint rows of a shared tile). tgmm has grid (groups, k_tiles, n_tiles);
  each program loops over its group's row tiles (dynamic trip count) with masked rows.

Both pad M, K and N up to multiples of the blocks (zeros, exact) and slice the result.
`interpret=True` runs either backend in the Pallas interpreter on CPU.

Why Triton on CUDA, not Mosaic GPU (the Triton backend is deprecated from JAX 0.11): JAX
ships Hopper Mosaic GPU grouped matmuls (pallas/ops/gpu/ragged_dot_mgpu.py and
transposed_ragged_dot_mgpu.py, bf16 wgmma). The forward one lowers for CUDA on a CPU host;
the transposed one (our tgmm, the weight gradient) does not in JAX 0.10.2 (AttributeError
while lowering off-GPU), so it cannot be lowering-tested here, and neither has been run on
our shapes (ragged rows past the groups, f32). Switching the CUDA branch of the dispatch is
owed to a session with a GPU that can check and time both against this kernel.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from kernels_pallas.grouped_matmul import metadata
from kernels_pallas.tiling import TileSizes, round_up

BACKENDS = ("mosaic_tpu", "triton")
_NN = (((1,), (0,)), ((), ()))  # [m, k] x [k, n]
_NT = (((1,), (1,)), ((), ()))  # [m, k] x [n, k]
_TN = (((0,), (0,)), ((), ()))  # [m, k] x [m, n] -> [k, n]


@dataclasses.dataclass(frozen=True)
class BlockSizes(TileSizes):
    """Tile sizes: rows (bm), contraction (bk), output columns (bn)."""

    bm: int = 128
    bk: int = 128
    bn: int = 128


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def fit_block(block: int, dim: int, backend: str, sublane: bool, strict: bool = True) -> int:
    """A legal block for `dim`: Triton wants powers of two (>= 16 for tl.dot); Mosaic wants
    multiples of (8, 128) on the last two block dims or the whole (padded) dim. With
    strict=False (interpret mode) Mosaic lane blocks need only be multiples of 8, so small
    test shapes still exercise several k/n tiles."""
    if backend == "triton":
        if block & (block - 1):
            raise ValueError(f"triton blocks must be powers of two, got {block}")
        return max(16, min(block, _next_pow2(dim)))
    if sublane:  # row tiles: a multiple of 8
        return min(round_up(block, 8), round_up(dim, 8))
    if dim <= block:
        return dim  # the full dimension is always a legal block
    if block % (128 if strict else 8):
        raise ValueError(f"mosaic_tpu blocks smaller than the dim must be multiples of "
                         f"{128 if strict else 8}, "
                         f"got {block} for a dim of {dim}")
    return block


def _pad(x: Array, shape: tuple[int, ...]) -> Array:
    return jnp.pad(x, [(0, s - d) for s, d in zip(shape, x.shape)])


def _out_struct(shape, dtype, *operands) -> jax.ShapeDtypeStruct:
    """Output spec varying over the shard_map axes its operands vary over, so the kernels
    also run inside shard_map with vma checking (outside it this is a plain struct)."""
    mats = [jax.typeof(o).mat for o in operands]
    varying = frozenset().union(*(m.varying for m in mats))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mats[0].update(varying=varying))


def compiler_params(backend: str, semantics: tuple[str, ...]):
    """The compiler parameters of every kernel launch in this module (looked up at call
    time, so scripts/gpu_check.py can swap in other Triton pipeline depths to diagnose)."""
    if backend == "triton":
        return pltriton.CompilerParams(num_warps=4, num_stages=2)
    return pltpu.CompilerParams(dimension_semantics=semantics)


# ----------------------------------------------------------------------------- gmm, TPU

def _gmm_mosaic_kernel(seg_ref, tile_ref, valid_ref, starts_ref, ends_ref,
                       lhs_ref, rhs_ref, out_ref, acc_ref, *, n_groups, bm, k_tiles,
                       transpose_rhs):
    v, k = pl.program_id(1), pl.program_id(2)
    seg = seg_ref[v]

    @pl.when(k == 0)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when((seg < n_groups) & (valid_ref[v] > 0))
    def _accumulate():
        acc_ref[...] += jax.lax.dot_general(lhs_ref[...], rhs_ref[...],
                                            _NT if transpose_rhs else _NN,
                                            preferred_element_type=jnp.float32)

    @pl.when(k == k_tiles - 1)
    def _write():
        rows = tile_ref[v] * bm + jax.lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0)
        mask = (rows >= starts_ref[seg]) & (rows < ends_ref[seg]) & (valid_ref[v] > 0)
        out_ref[...] = jnp.where(mask, acc_ref[...], out_ref[...].astype(jnp.float32)
                                 ).astype(out_ref.dtype)


def _gmm_mosaic(lhs, rhs, visits, *, n_groups, bm, bk, bn, transpose_rhs, interpret):
    m, kdim = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    k_tiles, n_tiles = kdim // bk, n // bn
    g_last = n_groups - 1

    def lhs_map(j, v, k, seg, tile, *_):
        return tile[v], k

    def rhs_map(j, v, k, seg, *_):
        g = jnp.minimum(seg[v], g_last)
        return (g, j, k) if transpose_rhs else (g, k, j)

    def out_map(j, v, k, seg, tile, *_):
        return tile[v], j

    rhs_block = (None, bn, bk) if transpose_rhs else (None, bk, bn)
    kernel = functools.partial(_gmm_mosaic_kernel, n_groups=n_groups, bm=bm,
                               k_tiles=k_tiles, transpose_rhs=transpose_rhs)
    return pl.pallas_call(
        kernel,
        out_shape=_out_struct((m, n), lhs.dtype, lhs, rhs, visits.segment),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(n_tiles, visits.segment.shape[0], k_tiles),
            in_specs=[pl.BlockSpec((bm, bk), lhs_map), pl.BlockSpec(rhs_block, rhs_map)],
            out_specs=pl.BlockSpec((bm, bn), out_map),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)]),
        compiler_params=compiler_params("mosaic_tpu", ("parallel", "arbitrary",
                                                        "arbitrary")),
        interpret=interpret, name="gmm_mosaic",
    )(visits.segment, visits.tile, visits.valid, visits.starts, visits.ends, lhs, rhs)


# --------------------------------------------------------------------------- gmm, Triton

def _gmm_triton_kernel(seg_ref, tile_ref, valid_ref, starts_ref, ends_ref, lhs_ref, rhs_ref,
                       out_ref, *, n_groups, bm, bk, bn, k_tiles, transpose_rhs):
    v, j = pl.program_id(0), pl.program_id(1)
    seg, tile, valid = seg_ref[v], tile_ref[v], valid_ref[v] > 0
    g = jnp.minimum(seg, n_groups - 1)
    rows, cols = pl.ds(tile * bm, bm), pl.ds(j * bn, bn)

    def body(k, acc):
        a = lhs_ref[rows, pl.ds(k * bk, bk)]
        if transpose_rhs:
            b = rhs_ref[g, cols, pl.ds(k * bk, bk)]
        else:
            b = rhs_ref[g, pl.ds(k * bk, bk), cols]
        return acc + jax.lax.dot_general(a, b, _NT if transpose_rhs else _NN,
                                         preferred_element_type=jnp.float32)

    # not jnp.where(cond, k_tiles, 0): Pallas' Triton lowering types a select of two int
    # literals as i1 (false, false), and scf.for then fails to verify on the GPU
    n_k = k_tiles * ((seg < n_groups) & valid).astype(jnp.int32)
    acc = jax.lax.fori_loop(0, n_k, body, jnp.zeros((bm, bn), jnp.float32))
    row_ids = tile * bm + jnp.arange(bm, dtype=jnp.int32)
    mask = (row_ids >= starts_ref[seg]) & (row_ids < ends_ref[seg]) & valid
    pltriton.store(out_ref.at[rows, cols], acc.astype(out_ref.dtype),
                   mask=jnp.broadcast_to(mask[:, None], (bm, bn)))


def _gmm_triton(lhs, rhs, visits, *, n_groups, bm, bk, bn, transpose_rhs, interpret):
    m, kdim = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    kernel = functools.partial(_gmm_triton_kernel, n_groups=n_groups, bm=bm, bk=bk, bn=bn,
                               k_tiles=kdim // bk, transpose_rhs=transpose_rhs)
    return pl.pallas_call(
        kernel, out_shape=_out_struct((m, n), lhs.dtype, lhs, rhs, visits.segment),
        grid=(visits.segment.shape[0], n // bn),
        compiler_params=compiler_params("triton", ()), interpret=interpret,
        name="gmm_triton",
    )(visits.segment, visits.tile, visits.valid, visits.starts, visits.ends, lhs, rhs)


def gmm(lhs: Float[Array, "M K"], rhs: Float[Array, "G K N"], group_sizes: Int[Array, "G"],
        *, block_sizes: BlockSizes = BlockSizes(), backend: str = "mosaic_tpu",
        interpret: bool = False, transpose_rhs: bool = False) -> Array:
    """out[m] = lhs[m] @ rhs[group(m)]; rhs is [G, N, K] when transpose_rhs. [M, N]."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    m, kdim = lhs.shape
    n_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    bm = fit_block(block_sizes.bm, m, backend, sublane=True)
    bk = fit_block(block_sizes.bk, kdim, backend, sublane=False, strict=not interpret)
    bn = fit_block(block_sizes.bn, n, backend, sublane=False, strict=not interpret)
    mp, kp, np_ = round_up(m, bm), round_up(kdim, bk), round_up(n, bn)
    lhs_p = _pad(lhs, (mp, kp))
    rhs_p = _pad(rhs, (n_groups, np_, kp) if transpose_rhs else (n_groups, kp, np_))
    visits = metadata.gmm_visits(group_sizes, m, mp, bm)
    impl = _gmm_triton if backend == "triton" else _gmm_mosaic
    out = impl(lhs_p, rhs_p, visits, n_groups=n_groups, bm=bm, bk=bk, bn=bn,
               transpose_rhs=transpose_rhs, interpret=interpret)
    return out[:m, :n]


# ---------------------------------------------------------------------------- tgmm, TPU

def _tgmm_mosaic_kernel(seg_ref, tile_ref, valid_ref, first_ref, last_ref, starts_ref,
                        ends_ref, lhs_ref, dout_ref, out_ref, acc_ref, *, bm):
    v = pl.program_id(2)
    seg = seg_ref[v]

    @pl.when(first_ref[v] > 0)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    rows = tile_ref[v] * bm + jax.lax.broadcasted_iota(jnp.int32, lhs_ref.shape, 0)
    mask = (rows >= starts_ref[seg]) & (rows < ends_ref[seg]) & (valid_ref[v] > 0)
    a = jnp.where(mask, lhs_ref[...], jnp.zeros_like(lhs_ref))
    acc_ref[...] += jax.lax.dot_general(a, dout_ref[...], _TN,
                                        preferred_element_type=jnp.float32)

    @pl.when(last_ref[v] > 0)
    def _write():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _tgmm_mosaic(lhs, dout, visits, *, n_groups, bm, bk, bn, interpret):
    kdim, n = lhs.shape[1], dout.shape[1]

    def lhs_map(i, j, v, seg, tile, *_):
        return tile[v], i

    def dout_map(i, j, v, seg, tile, *_):
        return tile[v], j

    def out_map(i, j, v, seg, *_):
        return seg[v], i, j

    return pl.pallas_call(
        functools.partial(_tgmm_mosaic_kernel, bm=bm),
        out_shape=_out_struct((n_groups, kdim, n), lhs.dtype, lhs, dout, visits.segment),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7,
            grid=(kdim // bk, n // bn, visits.segment.shape[0]),
            in_specs=[pl.BlockSpec((bm, bk), lhs_map), pl.BlockSpec((bm, bn), dout_map)],
            out_specs=pl.BlockSpec((None, bk, bn), out_map),
            scratch_shapes=[pltpu.VMEM((bk, bn), jnp.float32)]),
        compiler_params=compiler_params("mosaic_tpu", ("parallel", "parallel",
                                                        "arbitrary")),
        interpret=interpret, name="tgmm_mosaic",
    )(visits.segment, visits.tile, visits.valid, visits.first, visits.last, visits.starts,
      visits.ends, lhs, dout)


# -------------------------------------------------------------------------- tgmm, Triton

def _tgmm_triton_kernel(starts_ref, ends_ref, lhs_ref, dout_ref, out_ref, *, bm, bk, bn):
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = starts_ref[g], ends_ref[g]
    first_tile = start // bm
    stop_tile = jnp.where(end > start, (end - 1) // bm + 1, first_tile)
    kcols, ncols = pl.ds(i * bk, bk), pl.ds(j * bn, bn)

    def body(t, acc):
        rows = pl.ds(t * bm, bm)
        row_ids = t * bm + jnp.arange(bm, dtype=jnp.int32)
        inside = (row_ids >= start) & (row_ids < end)
        a = jnp.where(jnp.broadcast_to(inside[:, None], (bm, bk)), lhs_ref[rows, kcols], 0)
        return acc + jax.lax.dot_general(a, dout_ref[rows, ncols], _TN,
                                         preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(first_tile, stop_tile, body, jnp.zeros((bk, bn), jnp.float32))
    out_ref[g, kcols, ncols] = acc.astype(out_ref.dtype)


def _tgmm_triton(lhs, dout, visits, *, n_groups, bm, bk, bn, interpret):
    kdim, n = lhs.shape[1], dout.shape[1]
    return pl.pallas_call(
        functools.partial(_tgmm_triton_kernel, bm=bm, bk=bk, bn=bn),
        out_shape=_out_struct((n_groups, kdim, n), lhs.dtype, lhs, dout, visits.starts),
        grid=(n_groups, kdim // bk, n // bn),
        compiler_params=compiler_params("triton", ()), interpret=interpret,
        name="tgmm_triton",
    )(visits.starts, visits.ends, lhs, dout)


def tgmm(lhs: Float[Array, "M K"], dout: Float[Array, "M N"], group_sizes: Int[Array, "G"],
         *, block_sizes: BlockSizes = BlockSizes(), backend: str = "mosaic_tpu",
         interpret: bool = False) -> Array:
    """out[g] = lhs[rows of g].T @ dout[rows of g]. [G, K, N]."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    m, kdim = lhs.shape
    n, n_groups = dout.shape[1], group_sizes.shape[0]
    bm = fit_block(block_sizes.bm, m, backend, sublane=True)
    bk = fit_block(block_sizes.bk, kdim, backend, sublane=False, strict=not interpret)
    bn = fit_block(block_sizes.bn, n, backend, sublane=False, strict=not interpret)
    mp, kp, np_ = round_up(m, bm), round_up(kdim, bk), round_up(n, bn)
    lhs_p, dout_p = _pad(lhs, (mp, kp)), _pad(dout, (mp, np_))
    visits = metadata.tgmm_visits(group_sizes, m, mp, bm)
    impl = _tgmm_triton if backend == "triton" else _tgmm_mosaic
    out = impl(lhs_p, dout_p, visits, n_groups=n_groups, bm=bm, bk=bk, bn=bn,
               interpret=interpret)
    return out[:, :kdim, :n]
