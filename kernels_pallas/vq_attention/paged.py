"""Pallas decode attention over VQ codes held in pages, read through the block table.

Pages are the paged layout's records (research/kv/paged.py) of a VQ codec (TaSQ, CQ):

    k_pages, v_pages  [N, block_size, Hkv, G] uint8   page n holds block_size tokens' codes
    block_table       [B, M] int32                     row b's m-th page; -1 = unmapped
    lengths           [B]                              row b attends to its first lengths[b]

Row b's token at position p is page block_table[b, p // block_size]'s slot
p % block_size (keys coded before RoPE are rotated at p). Nothing gathers a row's pages
into a contiguous buffer: each kernel reads a page's code tile where the table points, so
the bytes read are the live codes (1/16 of bf16's at 1 bit per channel) plus the table.

Same split-K online softmax and log-sum-exp combine as the dense kernels (kernel.py), with
a page as the unit of work:

- GPU (Triton), grid (B, Hkv, n_splits): each program loops over its split's live pages,
  reads `table[b, p]`, loads the page's [block_size, G] code tile of its KV head, and
  dequantizes it in registers (`kernel.dequantize_codes`: centroids by pointer gather from
  the flat table) for flash-decoding dots, as the dense Triton body does per block.
- TPU (Mosaic), grid (B, n_splits, steps): the table and lengths are scalar-prefetched and
  `pages_per_step` page BlockSpecs (index_map `table[b, page]`, clamped to the live range)
  stream the pages; each page is read through the dense TPU body's one-hot matmuls
  (kernel._lut_scores / _rope_scores / _one_hot), its running max, sum and per-group
  accumulators kept in VMEM scratch across the steps of a split.

Block shapes come from the float paged kernel (`kernels_pallas.paged_attention.BlockSizes`:
pages per step and per split, Triton warps and stages). Default Triton warps by key space
(`default_block_sizes`), from the one H200 sweep at batch 32 x 32k tokens
(docs/gpu_h200_2026-12-04.md): post-RoPE 1 warp 2.03 ms vs 4 warps 3.09 ms; pre-RoPE
2 warps 5.35 ms vs 4 warps 5.53 ms (a [16, 64] page tile leaves most of 4 warps idle).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.paged_attention.kernel import (BlockSizes, live_pages, padded_table,
                                                   split_plan)
from kernels_pallas.vq_attention import kernel as dense
from kernels_pallas.vq_attention.rope import KeyRope

BACKENDS = dense.BACKENDS
_MASKED = dense._MASKED
_PRECISIONS = dense._PRECISIONS


def _last_page(length, block_size: int):
    """Index of a row's last live page (-1 when empty)."""
    return live_pages(length, block_size, None)[1]


# -- GPU (Triton) ------------------------------------------------------------------------
def _gpu_kernel(table_ref, len_ref, *refs, rope: bool, block_size: int, per_split: int,
                precision, n_groups: int, n_codes: int, gs: int):
    """One (batch row, KV head, split). Refs: the row's table [m_pad], length [1], query
    refs (kernel._gather_inputs), code pools [N, block_size, Hkv, G] (whole, in HBM), flat
    key/value centroid tables -> o [R, Dp] (unnormalised), m, l [R, 1]."""
    n_query = 3 if rope else 1
    query_refs = refs[:n_query]
    kc_ref, vc_ref, ktab_ref, vtab_ref, o_ref, m_ref, l_ref = refs[n_query:]
    rows, width = o_ref.shape
    h, split = pl.program_id(1), pl.program_id(2)
    length = len_ref[0]
    lo = split * per_split
    hi = jnp.minimum(_last_page(length, block_size) + 1, lo + per_split)
    dequant = functools.partial(dense.dequantize_codes, width=width, n_groups=n_groups,
                                n_codes=n_codes, gs=gs)

    def body(p, carry):
        page = table_ref[p]
        safe = jnp.maximum(page, 0)  # unmapped pages are read as page 0, then masked

        def codes(ref):
            return ref[safe, pl.ds(0, block_size), h, pl.ds(0, n_groups)].astype(jnp.int32)

        pos = p * block_size + jax.lax.broadcasted_iota(jnp.int32, (block_size, 1), 0)
        s = dense.gather_scores(query_refs, dequant(codes(kc_ref), ktab_ref), pos, rope,
                                precision)
        pos = p * block_size + jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
        s = jnp.where((pos < length) & (page >= 0), s, _MASKED)
        return dense.online_softmax_step(s, dequant(codes(vc_ref), vtab_ref), carry,
                                         precision)

    init = (jnp.full((rows, 1), _MASKED, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, width), jnp.float32))
    m, l, acc = jax.lax.fori_loop(lo, jnp.maximum(hi, lo), body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _gpu_call(q, k_pages, v_pages, k_codebook, v_codebook, table, lengths, key_rope, *,
              hkv, sm_scale, rows, precision, block_sizes, interpret):
    b, _, d = q.shape
    _, block_size, _, n_groups = k_pages.shape
    _, _, n_codes, gs = k_codebook.shape
    per_split, n_splits = split_plan(table.shape[1], block_sizes, 1)
    m_pad = pl.next_power_of_2(per_split * n_splits)  # Triton loads power-of-two rows
    table = padded_table(table, m_pad)
    width = dense._next_pow2(d, 16)
    query, query_specs, tables, table_specs = dense._gather_inputs(
        q, k_codebook, v_codebook, key_rope, hkv, sm_scale, rows, width)
    kernel = functools.partial(_gpu_kernel, rope=key_rope is not None, block_size=block_size,
                               per_split=per_split, precision=precision, n_groups=n_groups,
                               n_codes=n_codes, gs=gs)
    o_spec = pl.BlockSpec((None, None, None, rows, width), lambda i, h, j: (i, h, j, 0, 0))
    stats_spec = pl.BlockSpec((None, None, None, rows, 1), lambda i, h, j: (i, h, j, 0, 0))
    stats = jax.ShapeDtypeStruct((b, hkv, n_splits, rows, 1), jnp.float32)
    pool = pl.BlockSpec(memory_space=pl.ANY)
    o, m, l = pl.pallas_call(
        kernel, grid=(b, hkv, n_splits),
        in_specs=[pl.BlockSpec((None, m_pad), lambda i, h, j: (i, 0)),
                  pl.BlockSpec((None, 1), lambda i, h, j: (i, 0)), *query_specs, pool, pool,
                  *table_specs],
        out_specs=[o_spec, stats_spec, stats_spec],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, n_splits, rows, width), jnp.float32),
                   stats, stats],
        compiler_params=pltriton.CompilerParams(num_warps=block_sizes.num_warps,
                                                num_stages=block_sizes.num_stages),
        interpret=interpret,
        name="vq_paged_decode_attention" if key_rope is None
        else "vq_rope_paged_decode_attention",
    )(table, lengths[:, None], *query, k_pages, v_pages, *tables)
    return dense.merge_splits(o[:, :, :, None], m, l, rows, width)[..., :d]


# -- TPU (Mosaic) ------------------------------------------------------------------------
def _tpu_kernel(tbl_ref, len_ref, *refs, key_scores, n_key_refs: int, rope_freqs: bool,
                pages: int, block_size: int, steps: int, m_pad: int, precision,
                shared_codebook: bool):
    """One (batch row, split, step of `pages` pages), every KV head. Refs after the
    prefetched table and lengths: key-score refs (kernel._vq_decode_kernel's), the
    distinct frequencies when rope_freqs, `pages` key and `pages` value code pages
    [block_size, Hkv, G], value centroids [Hc, G, K, gp] -> o [Hkv, G, R, gp], m, l
    [Hkv, R, 1]; scratch m, l, acc of the same shapes."""
    key_refs, rest = refs[:n_key_refs], refs[n_key_refs:]
    freq_ref = None
    if rope_freqs:
        freq_ref, rest = rest[0], rest[1:]
    kc_refs, vc_refs = rest[:pages], rest[pages:2 * pages]
    vcb_ref, o_ref, m_out, l_out, m_ref, l_ref, acc_ref = rest[2 * pages:]
    hkv = m_ref.shape[0]
    n_groups, n_codes = vcb_ref.shape[1:3]
    b, split, step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = len_ref[b]
    base = (split * steps + step) * pages  # first logical page of this step

    @pl.when(step == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    code_ids = jax.lax.broadcasted_iota(jnp.int32, (block_size, n_codes), 1)
    for i in range(pages):
        page = base + i

        @pl.when(page <= _last_page(length, block_size))
        def _page(i=i, page=page):
            pos = page * block_size + jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
            valid = (pos < length) & (tbl_ref[b * m_pad + jnp.minimum(page, m_pad - 1)] >= 0)
            tables = None
            if freq_ref is not None:  # cos/sin once per distinct frequency and page
                col = (page * block_size + jax.lax.broadcasted_iota(
                    jnp.int32, (block_size, 1), 0)).astype(jnp.float32)
                ang = col * freq_ref[...]
                tables = (jnp.cos(ang), jnp.sin(ang))
            for h in range(hkv):
                hc = 0 if shared_codebook else h
                s = key_scores(key_refs, kc_refs[i], h, hc, 0, code_ids, tables, precision)
                s = jnp.where(valid, s, _MASKED)
                m_prev = m_ref[h]
                m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
                corr = jnp.exp(m_prev - m_next)
                p = jnp.exp(s - m_next)
                l_ref[h] = corr * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
                m_ref[h] = m_next
                for g in range(n_groups):
                    bins = jnp.dot(p, dense._one_hot(vc_refs[i], h, g, 0, code_ids),
                                   precision=precision)  # [R, K]
                    acc_ref[h, g] = corr * acc_ref[h, g] + jnp.dot(bins, vcb_ref[hc, g],
                                                                   precision=precision)

    @pl.when(step == steps - 1)
    def _out():
        o_ref[...] = acc_ref[...]
        m_out[...] = m_ref[...]
        l_out[...] = l_ref[...]


def _tpu_call(q, k_pages, v_pages, k_codebook, v_codebook, table, lengths, key_rope, *,
              hkv, sm_scale, rows, precision, block_sizes, interpret):
    b = q.shape[0]
    _, block_size, _, n_groups = k_pages.shape
    hc, _, n_codes, gs = v_codebook.shape
    gp = dense._next_pow2(gs, 16)
    m = table.shape[1]
    pages = min(block_sizes.pages_per_step, m)
    per_split, n_splits = split_plan(m, block_sizes, pages)
    steps, m_pad = per_split // pages, per_split * n_splits
    flat_table = padded_table(table, m_pad).reshape(-1)  # 1-D: SMEM pads 2-D arrays
    freqs = []
    if key_rope is None:
        key_inputs, _ = dense._lut_inputs(q, k_codebook, hkv, sm_scale, rows)
        key_scores, per_row = dense._lut_scores, 1
    else:
        key_inputs, _, freq = dense._rope_inputs(q, k_codebook, key_rope, hkv, sm_scale,
                                                 rows, gp)
        key_scores, per_row, freqs = dense._rope_scores, 2, [freq]  # A, B per row

    def whole(x):
        return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)

    def row(x):
        return pl.BlockSpec((None,) + x.shape[1:],
                            lambda bi, sp, st, tbl, lens: (bi,) + (0,) * (x.ndim - 1))

    def page_spec(i):
        def index(bi, sp, st, tbl, lens):  # clamped to the live range: no extra fetches
            last = jnp.maximum(_last_page(lens[bi], block_size), 0)
            page = jnp.minimum((sp * steps + st) * pages + i, last)
            return jnp.maximum(tbl[bi * m_pad + jnp.minimum(page, m_pad - 1)], 0), 0, 0, 0
        return pl.BlockSpec((None,) + k_pages.shape[1:], index)

    key_specs = [row(x) if j < per_row else whole(x) for j, x in enumerate(key_inputs)]
    vcb = jnp.pad(v_codebook.astype(jnp.float32), ((0, 0),) * 3 + ((0, gp - gs),))
    code_specs = [page_spec(i) for i in range(pages)]
    out_map = lambda bi, sp, st, tbl, lens: (bi, 0, sp, 0, 0, 0)  # noqa: E731
    stats_map = lambda bi, sp, st, tbl, lens: (bi, 0, sp, 0, 0)  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(b, n_splits, steps),
        in_specs=[*key_specs, *[whole(f) for f in freqs], *code_specs, *code_specs,
                  whole(vcb)],
        out_specs=[pl.BlockSpec((None, hkv, None, n_groups, rows, gp), out_map),
                   pl.BlockSpec((None, hkv, None, rows, 1), stats_map),
                   pl.BlockSpec((None, hkv, None, rows, 1), stats_map)],
        scratch_shapes=[pltpu.VMEM((hkv, rows, 1), jnp.float32),
                        pltpu.VMEM((hkv, rows, 1), jnp.float32),
                        pltpu.VMEM((hkv, n_groups, rows, gp), jnp.float32)])
    kernel = functools.partial(_tpu_kernel, key_scores=key_scores, n_key_refs=len(key_inputs),
                               rope_freqs=bool(freqs), pages=pages, block_size=block_size,
                               steps=steps, m_pad=m_pad, precision=precision,
                               shared_codebook=hc == 1 and hkv > 1)
    stats = jax.ShapeDtypeStruct((b, hkv, n_splits, rows, 1), jnp.float32)
    o, m_, l_ = pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((b, hkv, n_splits, n_groups, rows, gp), jnp.float32),
                   stats, stats],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="vq_paged_decode_attention" if key_rope is None
        else "vq_rope_paged_decode_attention",
    )(flat_table, lengths, *key_inputs, *freqs, *([k_pages] * pages), *([v_pages] * pages),
      vcb)
    return dense.merge_splits(o, m_, l_, rows, gs)


def default_block_sizes(backend: str, pre_rope: bool) -> BlockSizes:
    """Launch shape when none is given (module docstring)."""
    if backend == "triton":
        return BlockSizes(num_warps=2 if pre_rope else 1)
    return BlockSizes()


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret", "backend",
                                             "sm_scale", "precision"))
def vq_paged_decode_attention_pallas(q, k_pages, v_pages, k_codebook, v_codebook, block_table,
                                     lengths, key_rope: KeyRope | None = None, *,
                                     block_sizes: BlockSizes | None = None,
                                     interpret: bool = False, backend: str = "triton",
                                     sm_scale: float | None = None,
                                     precision: str = "highest"):
    """Decode attention [B, Hq, D] over code pages read through `block_table`; arguments as
    in `api.vq_decode_attention_paged_codes` (which validates them)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    b, hq, d = q.shape
    _, block_size, hkv, n_groups = k_pages.shape
    gs = v_codebook.shape[3]
    if backend == "triton" and not interpret and not gpu_supports(block_size, n_groups, gs, d):
        raise ValueError(f"the compiled Triton paged VQ kernel needs power-of-two block_size "
                         f">= 16, code groups and group size, and head_dim >= 16, got "
                         f"block_size={block_size}, G={n_groups}, group size {gs}, "
                         f"head_dim {d}")
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    block_sizes = block_sizes or default_block_sizes(backend, key_rope is not None)
    call = _gpu_call if backend == "triton" else _tpu_call
    out = call(q, k_pages, v_pages, k_codebook, v_codebook, block_table,
               lengths.astype(jnp.int32), key_rope, hkv=hkv, sm_scale=sm_scale,
               rows=dense._next_pow2(hq // hkv, 16), precision=_PRECISIONS[precision],
               block_sizes=block_sizes, interpret=interpret)
    return out[:, :, :hq // hkv].reshape(b, hq, d).astype(q.dtype)


def gpu_supports(block_size: int, n_groups: int, group_size: int, head_dim: int) -> bool:
    """Shapes the compiled Triton kernel can tile: a page is one [block_size, D] tile."""
    pow2 = lambda x: x & (x - 1) == 0  # noqa: E731
    return pow2(block_size) and block_size >= 16 and dense.gpu_supports(n_groups, group_size,
                                                                         head_dim)
