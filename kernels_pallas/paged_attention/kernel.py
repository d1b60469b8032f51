"""Pallas paged decode attention kernels: split-K online softmax over token-major pages.

Layout (research.kv paged layout, token axes lead):

    k_pool, v_pool  [N, block_size, Hkv, D]   page n holds block_size tokens of every KV head
    block_table     [B, M] int32              row b's m-th page; -1 = unmapped (masked)
    lengths         [B]                       row b attends to its first lengths[b] tokens
    k_scale, v_scale [N, block_size, Hkv, 1]  optional: pages hold int8 codes, token t of
                                              head h is page[t, h] * scale[t, h] (Int8Codec)

Scaled (int8) pages are dequantized one page tile at a time in VMEM/registers: only the
codes and their scales cross HBM, never a float copy of the pool. Their dots run in bf16
like bf16 pages' (codes are exact in bf16, the products of code and float16 scale round to
bf16): on an H200 f32 dots made the int8 kernel 2.1-4.4x slower than the bf16 kernel
(docs/gpu_h200_2026-12-04).

Both kernels split each row's M pages into `n_splits` context splits (flash decoding):
every (row, split) program writes an unnormalised partial output with its running max and
sum, and one log-sum-exp combine in XLA (`merge_splits`) finishes. The G = Hq/Hkv query
heads of a KV head are one tile, so each page is read once per row, not once per head.

- TPU (Mosaic): grid (B, n_splits, steps). The block table and lengths are
  scalar-prefetched (PrefetchScalarGridSpec); `pages_per_step` page BlockSpecs (one per
  page of the step, index_map `table[b, page]`) make the pipeline stream P pages per grid
  step. A page tile (block_size, Hkv, D) holds all KV heads, so one step scores all Hq
  query heads. Page indices are clamped to the row's live range [first, last] so steps
  past the length (or before the window) re-use the resident page instead of fetching one.
- GPU (Triton): grid (B, Hkv, n_splits). Triton has no scalar prefetch: each program loops
  over its split's pages, reads `table[b, p]` and loads the page's [block_size, D] tile of
  its KV head with a dynamic index; the G query heads (padded to 16 rows) meet it in one
  dot. Triton tiles are powers of two: block_size and D must be.

Why Triton and not Mosaic GPU on CUDA: the Triton backend is deprecated from JAX 0.11, but
this kernel's addressing is data dependent (the page of each step comes from the block
table in memory). Mosaic GPU (`jax.experimental.pallas.mosaic_gpu`) has no scalar prefetch
for BlockSpec index maps, and its gathers (TMA gather4) are Blackwell-only, so an H100/H200
version needs a hand-written per-page TMA copy loop with barriers; that port is left to a
session with a GPU to validate it. The dispatch (api.py) keeps Triton behind "auto".
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: exp(m_old - m_new) stays defined
_CONTRACT_LAST = (((1,), (1,)), ((), ()))
_CONTRACT_MID = (((1,), (0,)), ((), ()))


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """pages_per_step: pages per TPU grid step (P page DMAs in flight per step).
    pages_per_split: pages per context split (a multiple of pages_per_step after rounding);
    fewer splits for short contexts, more parallel programs for long ones.
    num_warps, num_stages: Triton launch parameters."""

    pages_per_step: int = 4
    pages_per_split: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("pages_per_step", "pages_per_split", "num_warps", "num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"BlockSizes.{name} must be >= 1, got {getattr(self, name)}")


def split_plan(m: int, block_sizes: BlockSizes, step: int) -> tuple[int, int]:
    """(pages per split, n_splits) for M pages: splits are whole steps of `step` pages."""
    per_split = min(block_sizes.pages_per_split, m)
    per_split = -(-per_split // step) * step
    return per_split, -(-m // per_split)


def padded_table(block_table, m_pad: int):
    """[B, M] table padded with -1 (unmapped) to [B, m_pad] int32."""
    b, m = block_table.shape
    return jnp.full((b, m_pad), -1, jnp.int32).at[:, :m].set(block_table.astype(jnp.int32))


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def live_pages(length, block_size: int, window: int | None):
    """[first, last] page of a row's attended tokens (last = first - 1 when empty)."""
    # lax.div (truncation; operands are >= 0): jnp's floor division lowers through `sign`,
    # which Mosaic only lowers when it can query the TPU generation
    last = jax.lax.div(length + block_size - 1, block_size) - 1
    first = 0 if window is None else jax.lax.div(jnp.maximum(length - window, 0), block_size)
    return first, last


def _online_softmax(q, keys, vals, valid, m, l, acc, precision):
    """q [R, D] (pre-scaled), keys/vals [T, D], valid [1, T] -> updated (m, l, acc)."""
    s = jax.lax.dot_general(q, keys, _CONTRACT_LAST, precision=precision,
                            preferred_element_type=jnp.float32)  # [R, T]
    s = jnp.where(valid, s, MASK)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    corr = jnp.exp(m - m_new)
    l_new = l * corr + jnp.sum(p, axis=1, keepdims=True)
    pv = jax.lax.dot_general(p.astype(vals.dtype), vals, _CONTRACT_MID, precision=precision,
                             preferred_element_type=jnp.float32)
    return m_new, l_new, acc * corr + pv


def merge_splits(o, m, l):
    """o [B, N, R, D] unnormalised partials, m/l [B, N, R, 1] -> [B, R, D] f32.
    Splits with no live token carry m = MASK, l = 0 (weight 0); an empty row gives 0."""
    m_all = jnp.max(m, axis=1, keepdims=True)
    corr = jnp.exp(m - m_all)
    l_all = jnp.sum(corr * l, axis=1)
    o_all = jnp.sum(corr * o, axis=1)
    return o_all / jnp.maximum(l_all, jnp.finfo(jnp.float32).tiny)


# -- TPU ---------------------------------------------------------------------------------
def _page_tile(refs, scale_refs, h: int):
    """Head h's tokens of the step's pages end to end [P*S, D]; int8 pages times their
    scales (in bf16, module docstring), float pages as stored."""
    x = jnp.concatenate([r[:, h, :] for r in refs], axis=0)
    if scale_refs is None:
        return widen(x)
    scales = jnp.concatenate([r[:, h, :] for r in scale_refs], axis=0)  # [P*S, 1]
    return (x.astype(jnp.float32) * scales.astype(jnp.float32)).astype(INT8_COMPUTE)


def _tpu_kernel(tbl_ref, len_ref, q_ref, *refs, pages: int, block_size: int, hkv: int,
                group: int, steps: int, m_pad: int, window: int | None, scale: float,
                precision, scaled: bool):
    k_refs, v_refs = refs[:pages], refs[pages:2 * pages]
    ks_refs = vs_refs = None
    if scaled:
        ks_refs, vs_refs = refs[2 * pages:3 * pages], refs[3 * pages:4 * pages]
        refs = refs[2 * pages:]
    o_ref, m_out, l_out, m_ref, l_ref, acc_ref = refs[2 * pages:]
    b, split, step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = len_ref[b]
    base = (split * steps + step) * pages  # first logical page of this step
    first, last = live_pages(length, block_size, window)

    @pl.when(step == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((base <= last) & (base + pages > first))
    def _step():
        n = pages * block_size
        t = jax.lax.broadcasted_iota(jnp.int32, (1, n), 1)
        pos = base * block_size + t
        valid = pos < length
        if window is not None:
            valid &= pos > length - 1 - window
        for i in range(pages):  # unmapped pages (-1) are masked, as in the reference
            page = jnp.minimum(base + i, m_pad - 1)
            in_page = (t >= i * block_size) & (t < (i + 1) * block_size)
            valid &= ~in_page | (tbl_ref[b * m_pad + page] >= 0)
        for h in range(hkv):
            rows = slice(h * group, (h + 1) * group)
            keys = _page_tile(k_refs, ks_refs, h)  # [P*S, D]
            vals = _page_tile(v_refs, vs_refs, h)
            q = (q_ref[rows, :].astype(jnp.float32) * scale).astype(keys.dtype)
            m, l, acc = _online_softmax(q, keys, vals, valid, m_ref[rows, :], l_ref[rows, :],
                                        acc_ref[rows, :], precision)
            m_ref[rows, :], l_ref[rows, :], acc_ref[rows, :] = m, l, acc

    @pl.when(step == steps - 1)
    def _out():
        o_ref[...] = acc_ref[...]
        m_out[...] = m_ref[...]
        l_out[...] = l_ref[...]


def paged_decode_attention_tpu(q, k_pool, v_pool, block_table, lengths, k_scale=None,
                               v_scale=None, *, window, interpret,
                               block_sizes: BlockSizes = BlockSizes()):
    """q [B, Hq, D] -> [B, Hq, D]; Mosaic TPU kernel (or its interpretation on CPU).
    k_scale/v_scale: int8 pages' scales (module docstring), or None."""
    b, hq, d = q.shape
    _, s, hkv, _ = k_pool.shape
    m = block_table.shape[1]
    pages = min(block_sizes.pages_per_step, m)
    per_split, n_splits = split_plan(m, block_sizes, pages)
    steps, m_pad = per_split // pages, per_split * n_splits
    table = padded_table(block_table, m_pad).reshape(-1)  # 1-D: SMEM pads 2-D arrays

    def page_map(i, width=d):
        def index(bi, sp, st, tbl, lens):
            first, last = live_pages(lens[bi], s, window)
            page = jnp.clip((sp * steps + st) * pages + i, first, jnp.maximum(last, first))
            return jnp.maximum(tbl[bi * m_pad + jnp.minimum(page, m_pad - 1)], 0), 0, 0, 0
        return pl.BlockSpec((None, s, hkv, width), index)

    row_spec = pl.BlockSpec((None, hq, d), lambda bi, sp, st, tbl, lens: (bi, 0, 0))
    out_spec = lambda w: pl.BlockSpec((None, None, hq, w),  # noqa: E731
                                      lambda bi, sp, st, tbl, lens: (bi, sp, 0, 0))
    kv_specs = [page_map(i) for i in range(pages)]
    scaled = k_scale is not None
    scale_specs = [page_map(i, 1) for i in range(pages)] * 2 if scaled else []
    scale_pools = [k_scale] * pages + [v_scale] * pages if scaled else []
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(b, n_splits, steps),
        in_specs=[row_spec, *kv_specs, *kv_specs, *scale_specs],
        out_specs=[out_spec(d), out_spec(1), out_spec(1)],
        scratch_shapes=[pltpu.VMEM((hq, 1), jnp.float32), pltpu.VMEM((hq, 1), jnp.float32),
                        pltpu.VMEM((hq, d), jnp.float32)])
    kernel = functools.partial(_tpu_kernel, pages=pages, block_size=s, hkv=hkv,
                               group=hq // hkv, steps=steps, m_pad=m_pad, window=window,
                               scale=d ** -0.5, precision=_precision(_compute_dtype(k_pool)),
                               scaled=scaled)
    stats = jax.ShapeDtypeStruct((b, n_splits, hq, 1), jnp.float32)
    o, m_, l_ = pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((b, n_splits, hq, d), jnp.float32), stats, stats],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret, name="paged_decode_attention_tpu",
    )(table, lengths.astype(jnp.int32), q, *([k_pool] * pages), *([v_pool] * pages),
      *scale_pools)
    return merge_splits(o, m_, l_).astype(q.dtype)


INT8_COMPUTE = jnp.bfloat16  # the dot dtype of int8 pages (module docstring)


def _compute_dtype(pool):
    """Scores and values are computed in the pool's float dtype; int8 and fp8 pages (one
    byte per channel: fp8 codecs fold their static scales into q and the output, see
    research/kv/fp8.py) in bf16."""
    wide = jnp.issubdtype(pool.dtype, jnp.floating) and pool.dtype.itemsize > 1
    return pool.dtype if wide else jnp.dtype(INT8_COMPUTE)


def widen(x):
    """A tile of fp8 pages in the compute dtype (bf16); wider floats as stored."""
    return x.astype(INT8_COMPUTE) if x.dtype.itemsize == 1 else x


# -- GPU (Triton) ------------------------------------------------------------------------
def gpu_supports(block_size: int, head_dim: int) -> bool:
    """Compiled Triton tiles are powers of two, dots need dims >= 16."""
    pow2 = lambda x: x & (x - 1) == 0  # noqa: E731
    return pow2(block_size) and pow2(head_dim) and block_size >= 16 and head_dim >= 16


def _gpu_kernel(table_ref, len_ref, q_ref, k_ref, v_ref, *refs, block_size: int,
                per_split: int, window: int | None, precision, scaled: bool):
    ks_ref = vs_ref = None
    if scaled:
        ks_ref, vs_ref, refs = refs[0], refs[1], refs[2:]
    o_ref, m_out, l_out = refs
    h, split = pl.program_id(1), pl.program_id(2)
    length = len_ref[0]
    q = q_ref[...]  # [Gp, D], pre-scaled f32 (or the pool dtype)
    rows, d = q.shape
    first, last = live_pages(length, block_size, window)
    lo = jnp.maximum(first, split * per_split)
    hi = jnp.minimum(last + 1, (split + 1) * per_split)

    def body(p, carry):
        page = table_ref[p]
        safe = jnp.maximum(page, 0)
        keys = _gpu_tile(k_ref, ks_ref, safe, h, block_size, d)
        vals = _gpu_tile(v_ref, vs_ref, safe, h, block_size, d)
        pos = p * block_size + jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
        valid = (pos < length) & (page >= 0)
        if window is not None:
            valid &= pos > length - 1 - window
        return _online_softmax(q, keys, vals, valid, *carry, precision)

    init = (jnp.full((rows, 1), MASK, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(lo, jnp.maximum(hi, lo), body, init)
    o_ref[...] = acc
    m_out[...] = m
    l_out[...] = l


def _gpu_tile(ref, scale_ref, page, h: int, block_size: int, d: int):
    """Head h's [block_size, D] tile of one page; int8 pages times their scales (bf16)."""
    x = ref[page, pl.ds(0, block_size), h, pl.ds(0, d)]
    if scale_ref is None:
        return widen(x)
    scales = scale_ref[page, pl.ds(0, block_size), h, pl.ds(0, 1)]  # [block_size, 1]
    return (x.astype(jnp.float32) * scales.astype(jnp.float32)).astype(INT8_COMPUTE)


def paged_decode_attention_gpu(q, k_pool, v_pool, block_table, lengths, k_scale=None,
                               v_scale=None, *, window, interpret,
                               block_sizes: BlockSizes = BlockSizes()):
    """q [B, Hq, D] -> [B, Hq, D]; Triton kernel (or its interpretation on CPU).
    k_scale/v_scale: int8 pages' scales (module docstring), or None."""
    b, hq, d = q.shape
    _, s, hkv, _ = k_pool.shape
    g, m = hq // hkv, block_table.shape[1]
    if not interpret and not gpu_supports(s, d):
        raise ValueError(f"the compiled Triton paged kernel needs power-of-two block_size "
                         f"and head_dim >= 16, got block_size={s}, head_dim={d}")
    per_split, n_splits = split_plan(m, block_sizes, 1)
    m_pad = pl.next_power_of_2(per_split * n_splits)
    table = padded_table(block_table, m_pad)
    rows = max(16, pl.next_power_of_2(g))
    qs = q.astype(jnp.float32).reshape(b, hkv, g, d) * d ** -0.5
    compute = _compute_dtype(k_pool)
    qs = jnp.pad(qs, ((0, 0), (0, 0), (0, rows - g), (0, 0))).astype(compute)
    scaled = k_scale is not None
    kernel = functools.partial(_gpu_kernel, block_size=s, per_split=per_split, window=window,
                               precision=_precision(compute), scaled=scaled)
    scale_specs = [pl.BlockSpec(memory_space=pl.ANY)] * 2 if scaled else []
    out_spec = lambda w: pl.BlockSpec((None, None, None, rows, w),  # noqa: E731
                                      lambda bi, h, sp: (bi, h, sp, 0, 0))
    stats = jax.ShapeDtypeStruct((b, hkv, n_splits, rows, 1), jnp.float32)
    o, m_, l_ = pl.pallas_call(
        kernel, grid=(b, hkv, n_splits),
        in_specs=[pl.BlockSpec((None, m_pad), lambda bi, h, sp: (bi, 0)),
                  pl.BlockSpec((None, 1), lambda bi, h, sp: (bi, 0)),
                  pl.BlockSpec((None, None, rows, d), lambda bi, h, sp: (bi, h, 0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY),
                  *scale_specs],
        out_specs=[out_spec(d), out_spec(1), out_spec(1)],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, n_splits, rows, d), jnp.float32), stats,
                   stats],
        compiler_params=pltriton.CompilerParams(num_warps=block_sizes.num_warps,
                                                num_stages=block_sizes.num_stages),
        interpret=interpret, name="paged_decode_attention_gpu",
    )(table, lengths.astype(jnp.int32)[:, None], qs, k_pool, v_pool,
      *([k_scale, v_scale] if scaled else []))
    # [B, Hkv, N, rows, .] -> splits second, rows = (KV head, query head of its group)
    o, m_, l_ = (x[:, :, :, :g].transpose(0, 2, 1, 3, 4).reshape(b, n_splits, hq, -1)
                 for x in (o, m_, l_))
    return merge_splits(o, m_, l_).astype(q.dtype)
