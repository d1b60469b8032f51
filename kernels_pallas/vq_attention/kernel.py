"""Pallas decode attention over token-major VQ codes (GQA), split-K ("flash decoding").

Codes are [B, S, Hkv, G] uint8 (one record per token; see reference.py). Each program
walks its context split in blocks of `block_kv` tokens with an online softmax and writes an
unnormalised partial output plus its running max and sum; one log-sum-exp combine in XLA
(`merge_splits`) finishes, as jax's GPU `decode_attention` does. The splits are
independent, which both Triton (programs cannot accumulate across the grid) and Mosaic TPU
need. The query heads of a KV head are one tile of R rows (padded to 16); lookup tables
and centroids are kernel inputs whose block index does not change along the grid, so they
are loaded once per program, not per block.

Two bodies, one per compiler, both reading only codes from HBM:

* Triton (GPU), grid (B, Hkv, N): pointer gathers. Each block of `block_kv` tokens is
  dequantized in registers, keys[t, c] = centroids[group(c), code[t, group(c)], c mod g],
  by indexing the flat centroid table (64 KiB per head at 1 bit, cache-resident) with the
  codes, then scored and accumulated with dots like dense flash decoding: the FLOPs of
  dense attention, 1/16 of its HBM bytes at 1 bit per channel.
* Mosaic (TPU), grid (B, N), every KV head in one program (a code tile [block_kv, Hkv, G]
  holds all heads). Mosaic rejects gathers, so codes are read through one-hot matmuls:
  per head and group, onehot[t, k] = (code[t, h, g] == k) (tokens on sublanes), then
      scores += LUT_hg [R, K] @ onehot^T                 (key scores from the lookup table)
      bins    = p [R, t] @ onehot [t, K]                 (softmax weights binned per code)
      acc_hg  = corr * acc_hg + bins @ centroids_hg [K, g] (values, never rebuilt per token)
  ~K/g times the FLOPs of dense attention, traded for bytes on the MXU.

Keys coded before RoPE (`key_rope`) cannot use a lookup table; each block of keys is
rebuilt (Triton: the gather above; Mosaic: onehot @ centroids_hg [t, g]) and scored at its
positions with the rotation moved onto the query (rope.KeyRope.query_terms):
    scores += A @ (keys * cos(omega p))^T + B @ (keys * sin(omega p))^T
On TPU cos/sin are evaluated once per distinct frequency and block ([block_kv, D/2]) and
routed to each head's codec channel order by an exact 0/1 selection matmul; the Triton
body evaluates them per channel (a register gather by frequency is not expressible).
Only codes cross HBM; dense keys exist one block at a time.

Why Triton and not Mosaic GPU on CUDA: the Triton backend is deprecated from JAX 0.11,
but both GPU paths need gathers (centroids by code), and Mosaic GPU
(`jax.experimental.pallas.mosaic_gpu`) has gathers only as Blackwell TMA gather4 and no
register gather; a one-hot (MXU-style) body on Hopper wgmma would cost K/g times the
FLOPs. So the dispatch (api.py) keeps this Triton kernel behind "auto" on CUDA.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.vq_attention.reference import lookup_tables
from kernels_pallas.vq_attention.rope import KeyRope

BACKENDS = ("triton", "mosaic_tpu")
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: avoids inf - inf = nan
_PRECISIONS = {"highest": jax.lax.Precision.HIGHEST, "default": jax.lax.Precision.DEFAULT}


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Context tokens per inner step and inner steps per grid program.

    On TPU each step builds [K, block_kv] one-hot tiles per group: 512 suits VMEM. On GPU
    each step dequantizes [block_kv, D] key and value tiles in registers: use ~64.
    """

    block_kv: int = 512
    blocks_per_split: int = 8
    # "highest": f32 dots (exact vs the reference); "default": the backend's fast path
    # (TF32 tensor cores on GPU, 1.5-1.7x faster on an H200; scores and softmax weights
    # round to ~1e-3 relative, one-hot operands stay exact)
    precision: str = "highest"

    def __post_init__(self):
        if self.precision not in _PRECISIONS:
            raise ValueError(f"precision must be one of {tuple(_PRECISIONS)}, got "
                             f"{self.precision!r}")
        if self.block_kv < 16 or self.block_kv & (self.block_kv - 1):
            raise ValueError(f"block_kv must be a power of two >= 16, got {self.block_kv}")
        if self.blocks_per_split < 1:
            raise ValueError(f"blocks_per_split must be >= 1, got {self.blocks_per_split}")


def _next_pow2(n: int, floor: int) -> int:
    return max(floor, 1 << (n - 1).bit_length())


def _one_hot(ref, h: int, g: int, start, code_ids):
    """[block_kv, K] f32: onehot[t, k] = (ref[start + t, h, g] == k) (tokens on sublanes,
    codes on lanes: the token-major codes need no transpose)."""
    codes = ref[pl.ds(start, code_ids.shape[0]), h, pl.ds(g, 1)].astype(jnp.int32)  # [T, 1]
    return (codes == code_ids).astype(jnp.float32)


_NT = (((1,), (1,)), ((), ()))  # [R, X] x [T, X] -> [R, T]
_TN = (((0,), (0,)), ((), ()))


def _lut_scores(key_refs, kc_ref, h: int, hc: int, start, code_ids, pos, precision):
    """Post-RoPE codes: scores [R, block_kv] = sum_g LUT[h, g] @ onehot_g^T."""
    del hc, pos  # the table is per query; post-RoPE scores do not depend on position
    (lut_ref,) = key_refs
    s = None
    for g in range(lut_ref.shape[1]):
        sg = jax.lax.dot_general(lut_ref[h, g], _one_hot(kc_ref, h, g, start, code_ids), _NT,
                                 precision=precision)
        s = sg if s is None else s + sg
    return s


def _rope_scores(key_refs, kc_ref, h: int, hc: int, start, code_ids, pos, precision):
    """Pre-RoPE codes: each group's keys are rebuilt (onehot @ centroids, [block_kv, gp])
    and scored as A_g . (k cos) + B_g . (k sin) at their positions (see rope.KeyRope:
    the rotation sits on the query terms A, B, so no channel crosses a group). cos/sin
    come from the block's table of distinct frequencies (`_rope_tables`)."""
    a_ref, b_ref, sel_ref, kcb_ref = key_refs
    cos_t, sin_t = pos  # [block_kv, F] over the distinct frequencies
    s = None
    for g in range(a_ref.shape[1]):
        keys = jnp.dot(_one_hot(kc_ref, h, g, start, code_ids), kcb_ref[hc, g],
                       precision=precision)  # [T, gp]
        cos = jnp.dot(cos_t, sel_ref[h, g], precision=jax.lax.Precision.HIGHEST)  # exact
        sin = jnp.dot(sin_t, sel_ref[h, g], precision=jax.lax.Precision.HIGHEST)
        sg = (jax.lax.dot_general(a_ref[h, g], keys * cos, _NT, precision=precision)
              + jax.lax.dot_general(b_ref[h, g], keys * sin, _NT, precision=precision))
        s = sg if s is None else s + sg
    return s


def _vq_decode_kernel(len_ref, *refs, key_scores, n_key_refs: int, block_kv: int,
                      blocks_per_split: int, read_length, precision, rope_freqs: bool,
                      shared_codebook: bool):
    """One (batch row, context split), every KV head, TPU body. Refs: the key-score refs
    (`_lut_scores`: lut [Hkv, G, R, K]; `_rope_scores`: A, B [Hkv, G, R, gp], channel
    selections [Hkv, G, F, gp], centroids [Hc, G, K, gp]; then the distinct frequencies
    [1, F] when rope_freqs), kc/vc [split, Hkv, G] uint8, vcb [Hc, G, K, gp] f32 ->
    o [Hkv, G, R, gp] (unnormalised), m [Hkv, R, 1], l [Hkv, R, 1]."""
    key_refs = refs[:n_key_refs]
    rest = refs[n_key_refs:]
    freq_ref = None
    if rope_freqs:
        freq_ref, rest = rest[0], rest[1:]
    kc_ref, vc_ref, vcb_ref, o_ref, m_ref, l_ref = rest
    hkv, rows = m_ref.shape[0], m_ref.shape[1]
    n_groups, n_codes, gp = vcb_ref.shape[1:]
    split_start = pl.program_id(1) * block_kv * blocks_per_split
    length = read_length(len_ref)
    n_blocks = jnp.clip(pl.cdiv(length - split_start, block_kv), 0, blocks_per_split)
    code_ids = jax.lax.broadcasted_iota(jnp.int32, (block_kv, n_codes), 1)

    def body(i, carry):
        start = pl.multiple_of(i * block_kv, block_kv)
        pos = split_start + start + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        valid = pos < length
        tables = None
        if freq_ref is not None:  # cos/sin once per distinct frequency and block
            col = (split_start + start + jax.lax.broadcasted_iota(
                jnp.int32, (block_kv, 1), 0)).astype(jnp.float32)
            ang = col * freq_ref[...]  # [T, F]
            tables = (jnp.cos(ang), jnp.sin(ang))
        out = []
        for h in range(hkv):
            hc = 0 if shared_codebook else h
            m_prev, l_prev, acc = carry[h]
            s = key_scores(key_refs, kc_ref, h, hc, start, code_ids, tables, precision)
            s = jnp.where(valid, s, _MASKED)
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            corr = jnp.exp(m_prev - m_next)
            p = jnp.exp(s - m_next)  # masked entries underflow to exactly 0
            l_next = corr * l_prev + jnp.sum(p, axis=1, keepdims=True)
            new_acc = []
            for g in range(n_groups):
                bins = jnp.dot(p, _one_hot(vc_ref, h, g, start, code_ids),
                               precision=precision)  # [R, K]
                new_acc.append(corr * acc[g] + jnp.dot(bins, vcb_ref[hc, g],
                                                       precision=precision))
            out.append((m_next, l_next, tuple(new_acc)))
        return tuple(out)

    head = (jnp.full((rows, 1), _MASKED, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            tuple(jnp.zeros((rows, gp), jnp.float32) for _ in range(n_groups)))
    final = jax.lax.fori_loop(0, n_blocks, body, (head,) * hkv)
    for h, (m, l, acc) in enumerate(final):
        for g in range(n_groups):
            o_ref[h, g] = acc[g]
        m_ref[h] = m
        l_ref[h] = l


def _dequantize_block(codes_ref, table_ref, start, block_kv: int, width: int, n_groups: int,
                      n_codes: int, gs: int):
    """[block_kv, width] f32: row t holds token start + t's centroids, groups end to end
    (`dequantize_codes` of the [block_kv, G] code tile at `start`)."""
    codes = codes_ref[pl.ds(start, block_kv), :].astype(jnp.int32)  # [T, G]
    return dequantize_codes(codes, table_ref, width, n_groups, n_codes, gs)


def dequantize_codes(codes, table_ref, width: int, n_groups: int, n_codes: int, gs: int):
    """codes [T, G] int32 -> [T, width] f32 centroids, groups end to end (Triton body).

    The codes arrive as one [T, G] tile (the token-major records of this KV head) and are
    spread over channels in registers (on an H200, spreading a code tile was 1.2-1.6x
    faster than gathering a code per (token, channel)); the centroids are a pointer gather
    from the flat table [G * K * gs]. Padded channels c >= G * gs read group G - 1's table
    with code 0; the zero-padded query ignores them."""
    block_kv = codes.shape[0]
    codes = jnp.broadcast_to(codes[:, :, None], (block_kv, n_groups, gs))
    code = codes.reshape(block_kv, n_groups * gs)
    if width > n_groups * gs:  # head_dim < 16: interpret mode only (Triton has no pad)
        code = jnp.pad(code, ((0, 0), (0, width - n_groups * gs)))
    chan = jax.lax.broadcasted_iota(jnp.int32, (block_kv, width), 1)
    group = jnp.minimum(chan // gs, n_groups - 1)
    return table_ref[(group * n_codes + code) * gs + chan % gs]


def gather_scores(query_refs, keys, pos, rope: bool, precision):
    """Triton body: scores [R, T] of a block of dequantized keys [T, Dp] at positions
    pos [T, 1]: q . k (post-RoPE codes), or A . (k cos) + B . (k sin) (pre-RoPE codes,
    query_refs = A, B [R, Dp], omega [1, Dp])."""
    if not rope:
        return jax.lax.dot_general(query_refs[0][...], keys, _NT, precision=precision)
    a_ref, b_ref, omega_ref = query_refs
    ang = pos.astype(jnp.float32) * omega_ref[...]
    return (jax.lax.dot_general(a_ref[...], keys * jnp.cos(ang), _NT, precision=precision)
            + jax.lax.dot_general(b_ref[...], keys * jnp.sin(ang), _NT, precision=precision))


def online_softmax_step(s, vals, carry, precision):
    """One block of masked scores s [R, T] (masked = _MASKED) and values [T, Dp] folded
    into (m, l, acc)."""
    m_prev, l_prev, acc = carry
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    corr = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next)  # masked entries underflow to exactly 0
    l_next = corr * l_prev + jnp.sum(p, axis=1, keepdims=True)
    return m_next, l_next, corr * acc + jnp.dot(p, vals, precision=precision)


def _vq_gather_kernel(len_ref, *refs, rope: bool, block_kv: int, blocks_per_split: int,
                      read_length, precision, n_groups: int, n_codes: int, gs: int):
    """One (batch row, KV head, split), GPU body. Refs: query q [R, Dp] (post-RoPE keys) or
    A, B [R, Dp] and omega [1, Dp] (pre-RoPE), then kc/vc [split, G] uint8, flat key and
    value centroid tables -> o [R, Dp] (unnormalised), m [R, 1], l [R, 1]."""
    n_query = 3 if rope else 1
    query_refs = refs[:n_query]
    kc_ref, vc_ref, ktab_ref, vtab_ref, o_ref, m_ref, l_ref = refs[n_query:]
    rows, width = o_ref.shape
    split_start = pl.program_id(2) * block_kv * blocks_per_split  # grid (B, Hkv, N)
    length = read_length(len_ref)
    n_blocks = jnp.clip(pl.cdiv(length - split_start, block_kv), 0, blocks_per_split)
    dequant = functools.partial(_dequantize_block, block_kv=block_kv, width=width,
                                n_groups=n_groups, n_codes=n_codes, gs=gs)

    def body(i, carry):
        start = pl.multiple_of(i * block_kv, block_kv)
        pos = split_start + start + jax.lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
        s = gather_scores(query_refs, dequant(kc_ref, ktab_ref, start), pos, rope, precision)
        pos = split_start + start + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        s = jnp.where(pos < length, s, _MASKED)
        return online_softmax_step(s, dequant(vc_ref, vtab_ref, start), carry, precision)

    init = (jnp.full((rows, 1), _MASKED, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, width), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _gather_inputs(q, k_codebook, v_codebook, key_rope, hkv, sm_scale, rows, width):
    """(refs, specs) of the GPU body's query side and flat centroid tables; grid (B, Hkv, N)."""
    _, hq, d = q.shape
    hc, n_groups, n_codes, gs = k_codebook.shape
    gq = hq // hkv
    pad_q = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, rows - gq), (0, width - d)))  # noqa
    q_spec = pl.BlockSpec((None, None, rows, width), lambda i, h, j: (i, h, 0, 0))
    if key_rope is None:
        query, specs = [pad_q(_scaled_query(q, hkv, sm_scale))], [q_spec]
    else:
        a, bt, omega = _rope_query_terms(q, key_rope, hkv, sm_scale)
        omega = jnp.pad(omega, ((0, 0), (0, width - d)))[:, None]  # [Hkv, 1, Dp]
        query = [pad_q(a), pad_q(bt), omega]
        specs = [q_spec, q_spec, pl.BlockSpec((None, 1, width), lambda i, h, j: (h, 0, 0))]
    flat = n_groups * n_codes * gs
    table_len = _next_pow2(flat, 16)
    tables = [jnp.pad(cb.astype(jnp.float32).reshape(hc, flat), ((0, 0), (0, table_len - flat)))
              for cb in (k_codebook, v_codebook)]
    cb_head = (lambda h: h) if hc == hkv else (lambda h: 0)
    table_spec = pl.BlockSpec((None, table_len), lambda i, h, j: (cb_head(h), 0))
    return query, specs, tables, [table_spec, table_spec]


def _scaled_query(q, hkv: int, sm_scale: float):
    """q [B, Hq, D] -> f32 [B, Hkv, gq, D] times sm_scale."""
    b, hq, d = q.shape
    return q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d) * sm_scale


def _rope_query_terms(q, key_rope: KeyRope, hkv: int, sm_scale: float):
    """(A, B [B, Hkv, gq, D], omega [Hkv, D]): the pre-RoPE scoring terms of both bodies."""
    rope = jax.tree.map(lambda x: jnp.broadcast_to(x, (hkv, q.shape[-1])), key_rope)
    a, bt = rope.query_terms(_scaled_query(q, hkv, sm_scale))
    return a, bt, rope.omega


def _whole(shape):
    """A BlockSpec of the whole array on the TPU grid (B, N)."""
    return pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))


def _lut_inputs(q, k_codebook, hkv, sm_scale, rows):
    """(refs, specs) of post-RoPE key scoring: LUT [B, Hkv, G, R, K]."""
    lut = lookup_tables(q[:, None], k_codebook, hkv, sm_scale)  # [B, Hkv, gq, G, K]
    gq = lut.shape[2]
    lut = jnp.pad(lut.transpose(0, 1, 3, 2, 4), ((0, 0),) * 3 + ((0, rows - gq), (0, 0)))
    spec = pl.BlockSpec((None,) + lut.shape[1:], lambda i, j: (i, 0, 0, 0, 0))
    return [lut], [spec]


def _rope_inputs(q, k_codebook, key_rope: KeyRope, hkv, sm_scale, rows, gp):
    """(refs, specs) of pre-RoPE key scoring: query terms A, B [B, Hkv, G, R, gp], channel
    selections [Hkv, G, F, gp] (sel[h, g, f, c] = channel g*gs + c of head h turns at the
    f-th distinct frequency), key centroids [Hc, G, K, gp] (channels padded by 0); then the
    distinct frequencies [1, F] (KeyRope.cos_sin's table: each frequency twice a head)."""
    b, hq, d = q.shape
    hc, n_groups, n_codes, gs = k_codebook.shape
    gq = hq // hkv
    a, bt, omega = _rope_query_terms(q, key_rope, hkv, sm_scale)

    def by_group(x):  # [B, Hkv, gq, D] -> [B, Hkv, G, rows, gp]
        x = x.reshape(b, hkv, gq, n_groups, gs).transpose(0, 1, 3, 2, 4)
        return jnp.pad(x, ((0, 0),) * 3 + ((0, rows - gq), (0, gp - gs)))

    freqs = jnp.sort(omega[0])[::2]  # [F = D/2]
    sel = jax.nn.one_hot(jnp.searchsorted(freqs, omega), freqs.shape[0])  # [Hkv, D, F]
    sel = sel.reshape(hkv, n_groups, gs, -1).transpose(0, 1, 3, 2)
    sel = jnp.pad(sel, ((0, 0),) * 3 + ((0, gp - gs),))
    kcb = jnp.pad(k_codebook.astype(jnp.float32), ((0, 0),) * 3 + ((0, gp - gs),))
    a_spec = pl.BlockSpec((None, hkv, n_groups, rows, gp), lambda i, j: (i, 0, 0, 0, 0))
    inputs = [by_group(a), by_group(bt), sel, kcb]
    specs = [a_spec, a_spec, _whole(sel.shape), _whole(kcb.shape)]
    return inputs, specs, freqs[None]


def _gather_call(q, k_codes, v_codes, k_codebook, v_codebook, lengths, key_rope, *, hkv,
                 sm_scale, rows, loop, split_len, n_splits, interpret):
    """GPU (Triton) body: grid (B, Hkv, N) -> (o [B, Hkv, N, R, Dp], m, l [B, Hkv, N, R, 1])."""
    b, _, d = q.shape
    _, n_groups, n_codes, gs = k_codebook.shape
    width = _next_pow2(d, 16)
    query, query_specs, tables, table_specs = _gather_inputs(
        q, k_codebook, v_codebook, key_rope, hkv, sm_scale, rows, width)
    kernel = functools.partial(_vq_gather_kernel, rope=key_rope is not None,
                               n_groups=n_groups, n_codes=n_codes, gs=gs,
                               read_length=lambda ref: ref[0], **loop)
    code_spec = pl.BlockSpec((None, split_len, None, n_groups), lambda i, h, j: (i, j, h, 0))
    o_spec = pl.BlockSpec((None, None, None, rows, width), lambda i, h, j: (i, h, j, 0, 0))
    stats_spec = pl.BlockSpec((None, None, None, rows, 1), lambda i, h, j: (i, h, j, 0, 0))
    stats = jax.ShapeDtypeStruct((b, hkv, n_splits, rows, 1), jnp.float32)
    o, m, l = pl.pallas_call(
        kernel, grid=(b, hkv, n_splits),
        in_specs=[pl.BlockSpec((1,), lambda i, h, j: (i,)), *query_specs, code_spec,
                  code_spec, *table_specs],
        out_specs=[o_spec, stats_spec, stats_spec],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, n_splits, rows, width), jnp.float32),
                   stats, stats],
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="vq_decode_attention" if key_rope is None else "vq_rope_decode_attention",
    )(lengths, *query, k_codes, v_codes, *tables)
    # one [R, Dp] partial per split: a single "group" of Dp channels
    return merge_splits(o[:, :, :, None], m, l, rows, o.shape[-1])[..., :d]


def _one_hot_call(q, k_codes, v_codes, k_codebook, v_codebook, lengths, key_rope, *, hkv,
                  sm_scale, rows, loop, split_len, n_splits, interpret):
    """TPU (Mosaic) body: grid (B, N), every KV head per program ->
    (o [B, Hkv, N, G, R, gp], m, l [B, Hkv, N, R, 1])."""
    b = q.shape[0]
    hc, n_groups, n_codes, gs = v_codebook.shape
    gp = _next_pow2(gs, 16)
    freqs = []
    if key_rope is None:
        key_inputs, key_specs = _lut_inputs(q, k_codebook, hkv, sm_scale, rows)
        key_scores = _lut_scores
    else:
        key_inputs, key_specs, freq = _rope_inputs(q, k_codebook, key_rope, hkv, sm_scale,
                                                   rows, gp)
        key_scores, freqs = _rope_scores, [freq]
    vcb = jnp.pad(v_codebook.astype(jnp.float32), ((0, 0),) * 3 + ((0, gp - gs),))
    kernel = functools.partial(_vq_decode_kernel, key_scores=key_scores,
                               n_key_refs=len(key_inputs), rope_freqs=bool(freqs),
                               shared_codebook=hc == 1 and hkv > 1,
                               read_length=lambda ref: ref[pl.program_id(0)], **loop)
    code_spec = pl.BlockSpec((None, split_len, hkv, n_groups), lambda i, j: (i, j, 0, 0))
    o_spec = pl.BlockSpec((None, hkv, None, n_groups, rows, gp),
                          lambda i, j: (i, 0, j, 0, 0, 0))
    stats_spec = pl.BlockSpec((None, hkv, None, rows, 1), lambda i, j: (i, 0, j, 0, 0))
    stats = jax.ShapeDtypeStruct((b, hkv, n_splits, rows, 1), jnp.float32)
    o, m, l = pl.pallas_call(
        kernel, grid=(b, n_splits),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), *key_specs,
                  *[_whole(f.shape) for f in freqs], code_spec, code_spec, _whole(vcb.shape)],
        out_specs=[o_spec, stats_spec, stats_spec],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, n_splits, n_groups, rows, gp), jnp.float32),
                   stats, stats],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="vq_decode_attention" if key_rope is None else "vq_rope_decode_attention",
    )(lengths, *key_inputs, *freqs, k_codes, v_codes, vcb)
    return merge_splits(o, m, l, rows, gs)


def gpu_supports(n_groups: int, group_size: int, head_dim: int) -> bool:
    """Shapes the compiled Triton kernel can tile (Triton tensors are powers of two; dot
    tiles need head_dim >= 16)."""
    pow2 = lambda x: x & (x - 1) == 0  # noqa: E731
    return pow2(n_groups) and pow2(group_size) and head_dim >= 16


DEFAULT_BLOCKS = {"mosaic_tpu": BlockSizes(block_kv=512, blocks_per_split=8),
                  "triton": BlockSizes(block_kv=64, blocks_per_split=32)}


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret", "backend",
                                             "sm_scale"))
def vq_decode_attention_pallas(q, k_codes, v_codes, k_codebook, v_codebook, lengths,
                               key_rope: KeyRope | None = None, *,
                               block_sizes: BlockSizes | None = None, interpret: bool = False,
                               backend: str = "triton", sm_scale: float | None = None):
    """Decode attention [B, Hq, D] over token-major codes [B, S, Hkv, G]; arguments as in
    `api.vq_decode_attention` (which validates them). `key_rope`: keys were coded before
    RoPE (slot = position). block_sizes None: DEFAULT_BLOCKS[backend]."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    block_sizes = block_sizes or DEFAULT_BLOCKS[backend]
    b, hq, d = q.shape
    _, s, hkv, n_groups = k_codes.shape
    gs = v_codebook.shape[3]
    if backend == "triton" and not interpret and not gpu_supports(n_groups, gs, d):
        raise ValueError(f"the compiled Triton kernel needs power-of-two code groups and group "
                         f"size (Triton tensors are powers of two) and head_dim >= 16 (dot "
                         f"tiles), got G={n_groups}, group size {gs}, head_dim {d}")
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    rows = _next_pow2(hq // hkv, 16)  # Triton dots need dims >= 16; TPU sublanes 8
    bkv = min(block_sizes.block_kv, _next_pow2(s, 16))
    bps = min(block_sizes.blocks_per_split, pl.cdiv(s, bkv))
    split_len = bkv * bps
    n_splits = pl.cdiv(s, split_len)
    pad = ((0, 0), (0, n_splits * split_len - s), (0, 0), (0, 0))
    k_codes, v_codes = jnp.pad(k_codes, pad), jnp.pad(v_codes, pad)
    loop = dict(block_kv=bkv, blocks_per_split=bps,
                precision=_PRECISIONS[block_sizes.precision])
    call = _gather_call if backend == "triton" else _one_hot_call
    out = call(q, k_codes, v_codes, k_codebook, v_codebook, lengths.astype(jnp.int32),
               key_rope, hkv=hkv, sm_scale=sm_scale, rows=rows, loop=loop,
               split_len=split_len, n_splits=n_splits, interpret=interpret)
    return out[:, :, :hq // hkv].reshape(b, hq, d).astype(q.dtype)


def merge_splits(o, m, l, rows: int, gs: int):
    """Combine split partials: o [B, Hkv, N, G, R, gp], m/l [B, Hkv, N, R, 1] ->
    [B, Hkv, R, G * gs].

    Splits past a row's length carry m = _MASKED and l = 0, so their weight is exactly 0;
    a row with no tokens at all gives zeros (as the reference does)."""
    m_all = jnp.max(m, axis=2, keepdims=True)
    corr = jnp.exp(m - m_all)  # [B, Hkv, N, R, 1]
    l_all = jnp.sum(corr * l, axis=2)  # [B, Hkv, R, 1]
    o_all = jnp.sum(corr[:, :, :, None] * o, axis=2)  # [B, Hkv, G, R, gp]
    o_all = o_all / jnp.maximum(l_all, jnp.finfo(jnp.float32).tiny)[:, :, None]
    o_all = o_all[:, :, :, :rows, :gs]  # drop padded channels
    bb, hkv, g = o_all.shape[:3]
    return o_all.transpose(0, 1, 3, 2, 4).reshape(bb, hkv, rows, g * gs)
