"""Pallas decode attention over VQ codes (GQA), split-K ("flash decoding") schedule.

Grid (batch, KV head, context split). Each program walks its split in blocks of
`block_kv` tokens with an online softmax and writes an unnormalised partial output plus
its running max and sum; the wrapper merges the splits (log-sum-exp), as jax's GPU
`decode_attention` does. The splits are independent, which both Triton (grid programs run
in parallel and cannot accumulate across the grid) and Mosaic TPU need.

Two bodies, one per compiler, both reading only codes from HBM:

* Triton (GPU): pointer gathers. Each block of `block_kv` tokens is dequantized in
  registers, keys[t, c] = centroids[group(c), code[group(c), t], c mod g], by indexing the
  flat centroid table (64 KiB per head at 1 bit, cache-resident) with the codes, then
  scored and accumulated with dots like dense flash decoding: the FLOPs of dense
  attention, 1/16 of its HBM bytes at 1 bit per channel.
* Mosaic (TPU): Mosaic rejects gathers, so codes are read through one-hot matmuls: per
  group g, onehot[k, t] = (code[g, t] == k), then
      scores += LUT_g [rows, K] @ onehot [K, t]          (key scores from the lookup table)
      bins    = p [rows, t] @ onehot^T [t, K]            (softmax weights binned per code)
      acc_g   = corr * acc_g + bins @ centroids_g [K, g] (values, never rebuilt per token)
  ~K/g times the FLOPs of dense attention, traded for bytes on the MXU. (This body also
  compiles for Triton, but its loop-invariant [rows, K] tables overflow a GPU's shared
  memory: 297-401 KiB requested of 227 KiB on an H200.)

Keys coded before RoPE (`key_rope`) cannot use a lookup table; each block of keys is
rebuilt (Triton: the gather above; Mosaic: onehot^T @ centroids_g [t, g] per group) and
scored at its positions with the rotation moved onto the query (rope.KeyRope.query_terms):
    scores += A @ (keys * cos(omega p))^T + B @ (keys * sin(omega p))^T
Only codes cross HBM; dense keys exist one block at a time.
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


def _one_hot(ref, g, start, code_ids):
    """[K, block_kv] f32: onehot[k, t] = (ref[g, start + t] == k)."""
    codes = ref[pl.ds(g, 1), pl.ds(start, code_ids.shape[1])].astype(jnp.int32)
    return (codes == code_ids).astype(jnp.float32)


def _lut_scores(key_refs, kc_ref, start, code_ids, split_start, precision):
    """Post-RoPE codes: scores [R, block_kv] = sum_g LUT_g @ onehot_g."""
    del split_start  # post-RoPE scores do not depend on position
    (lut_ref,) = key_refs
    s = jnp.zeros((lut_ref.shape[1], code_ids.shape[1]), jnp.float32)
    for g in range(lut_ref.shape[0]):
        s += jnp.dot(lut_ref[g], _one_hot(kc_ref, g, start, code_ids), precision=precision)
    return s


def _rope_scores(key_refs, kc_ref, start, code_ids, split_start, precision):
    """Pre-RoPE codes: each group's keys are rebuilt (onehot^T @ centroids, [block_kv, gp])
    and scored as A_g . (k cos) + B_g . (k sin) at their positions (see rope.KeyRope:
    the rotation sits on the query terms A, B, so no channel crosses a group)."""
    a_ref, b_ref, omega_ref, kcb_ref = key_refs
    block_kv = code_ids.shape[1]
    pos = split_start + start + jax.lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
    pos = pos.astype(jnp.float32)
    contract_last = (((1,), (1,)), ((), ()))
    s = jnp.zeros((a_ref.shape[1], block_kv), jnp.float32)
    for g in range(a_ref.shape[0]):
        keys = jax.lax.dot_general(_one_hot(kc_ref, g, start, code_ids), kcb_ref[g],
                                   (((0,), (0,)), ((), ())), precision=precision)
        ang = pos * omega_ref[g]  # [block_kv, gp]
        s += jax.lax.dot_general(a_ref[g], keys * jnp.cos(ang), contract_last,
                                 precision=precision)
        s += jax.lax.dot_general(b_ref[g], keys * jnp.sin(ang), contract_last,
                                 precision=precision)
    return s


def _vq_decode_kernel(len_ref, *refs, key_scores, n_key_refs: int, block_kv: int,
                      blocks_per_split: int, read_length, precision):
    """One (batch row, KV head, split). Refs: the key-score refs (`_lut_scores`:
    lut [G, R, K]; `_rope_scores`: A, B [G, R, gp], omega [G, 1, gp], centroids
    [G, K, gp]), then kc/vc [G, split] uint8, vcb [G, K, gp] f32 ->
    o [G, R, gp] (unnormalised), m [R, 1], l [R, 1]."""
    key_refs = refs[:n_key_refs]
    kc_ref, vc_ref, vcb_ref, o_ref, m_ref, l_ref = refs[n_key_refs:]
    n_groups, n_codes, gp = vcb_ref.shape
    rows = m_ref.shape[0]
    split_len = block_kv * blocks_per_split
    split_start = pl.program_id(2) * split_len
    length = read_length(len_ref)
    n_blocks = jnp.clip(pl.cdiv(length - split_start, block_kv), 0, blocks_per_split)
    code_ids = jax.lax.broadcasted_iota(jnp.int32, (n_codes, block_kv), 0)

    def body(i, carry):
        m_prev, l_prev, acc = carry
        start = pl.multiple_of(i * block_kv, block_kv)
        s = key_scores(key_refs, kc_ref, start, code_ids, split_start, precision)
        pos = split_start + start + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        s = jnp.where(pos < length, s, _MASKED)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        corr = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next)  # masked entries underflow to exactly 0
        l_next = corr * l_prev + jnp.sum(p, axis=1, keepdims=True)
        new_acc = []
        for g in range(n_groups):
            bins = jax.lax.dot_general(p, _one_hot(vc_ref, g, start, code_ids),
                                       (((1,), (1,)), ((), ())), precision=precision)  # [R, K]
            new_acc.append(corr * acc[g] + jnp.dot(bins, vcb_ref[g], precision=precision))
        return m_next, l_next, tuple(new_acc)

    init = (jnp.full((rows, 1), _MASKED, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            tuple(jnp.zeros((rows, gp), jnp.float32) for _ in range(n_groups)))
    m, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    for g in range(n_groups):
        o_ref[g] = acc[g]
    m_ref[...] = m
    l_ref[...] = l


def _dequantize_block(codes_ref, table_ref, start, block_kv: int, width: int, n_groups: int,
                      n_codes: int, gs: int):
    """[block_kv, width] f32: row t holds token start + t's centroids, groups end to end.

    The codes arrive as one contiguous [G, block_kv] tile and are spread over channels in
    registers (on an H200 this read is 1.2-1.6x faster than gathering a code per (token,
    channel)); the centroids are a pointer gather from the flat table [G * K * gs]. Padded
    channels c >= G * gs read group G - 1's table with code 0; the zero-padded query
    ignores them."""
    codes = codes_ref[:, pl.ds(start, block_kv)].astype(jnp.int32)  # [G, T]
    codes = jnp.broadcast_to(codes.T[:, :, None], (block_kv, n_groups, gs))
    code = codes.reshape(block_kv, n_groups * gs)
    if width > n_groups * gs:  # head_dim < 16: interpret mode only (Triton has no pad)
        code = jnp.pad(code, ((0, 0), (0, width - n_groups * gs)))
    chan = jax.lax.broadcasted_iota(jnp.int32, (block_kv, width), 1)
    group = jnp.minimum(chan // gs, n_groups - 1)
    return table_ref[(group * n_codes + code) * gs + chan % gs]


def _vq_gather_kernel(len_ref, *refs, rope: bool, block_kv: int, blocks_per_split: int,
                      read_length, precision, n_groups: int, n_codes: int, gs: int):
    """One (batch row, KV head, split), GPU body. Refs: query q [R, Dp] (post-RoPE keys) or
    A, B [R, Dp] and omega [1, Dp] (pre-RoPE), then kc/vc [G, split] uint8, flat key and
    value centroid tables -> o [R, Dp] (unnormalised), m [R, 1], l [R, 1]."""
    n_query = 3 if rope else 1
    query_refs = refs[:n_query]
    kc_ref, vc_ref, ktab_ref, vtab_ref, o_ref, m_ref, l_ref = refs[n_query:]
    rows, width = o_ref.shape
    split_start = pl.program_id(2) * block_kv * blocks_per_split
    length = read_length(len_ref)
    n_blocks = jnp.clip(pl.cdiv(length - split_start, block_kv), 0, blocks_per_split)
    dequant = functools.partial(_dequantize_block, block_kv=block_kv, width=width,
                                n_groups=n_groups, n_codes=n_codes, gs=gs)
    contract_last = (((1,), (1,)), ((), ()))

    def scores(keys, start):
        if not rope:
            return jax.lax.dot_general(query_refs[0][...], keys, contract_last,
                                       precision=precision)
        a_ref, b_ref, omega_ref = query_refs
        pos = split_start + start + jax.lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
        ang = pos.astype(jnp.float32) * omega_ref[...]
        return (jax.lax.dot_general(a_ref[...], keys * jnp.cos(ang), contract_last,
                                    precision=precision)
                + jax.lax.dot_general(b_ref[...], keys * jnp.sin(ang), contract_last,
                                      precision=precision))

    def body(i, carry):
        m_prev, l_prev, acc = carry
        start = pl.multiple_of(i * block_kv, block_kv)
        s = scores(dequant(kc_ref, ktab_ref, start), start)
        pos = split_start + start + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        s = jnp.where(pos < length, s, _MASKED)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        corr = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next)
        l_next = corr * l_prev + jnp.sum(p, axis=1, keepdims=True)
        vals = dequant(vc_ref, vtab_ref, start)
        return m_next, l_next, corr * acc + jnp.dot(p, vals, precision=precision)

    init = (jnp.full((rows, 1), _MASKED, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, width), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _gather_inputs(q, k_codebook, v_codebook, key_rope, hkv, sm_scale, rows, width):
    """(refs, specs) of the GPU body's query side and flat centroid tables."""
    _, hq, d = q.shape
    hc, n_groups, n_codes, gs = k_codebook.shape
    gq = hq // hkv
    pad_q = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, rows - gq), (0, width - d)))
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
    cb_head = _codebook_head(hc, hkv)
    table_spec = pl.BlockSpec((None, table_len), lambda i, h, j: (cb_head(h), 0))
    return query, specs, tables, [table_spec, table_spec]


def _compiler_params(backend: str):
    if backend == "triton":
        return pltriton.CompilerParams(num_warps=4, num_stages=2)
    return pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel"))


def _lengths_spec(backend: str):
    """Row lengths: scalars in SMEM on TPU; a 1-element block elsewhere."""
    if backend == "mosaic_tpu":
        return (pl.BlockSpec(memory_space=pltpu.SMEM),
                lambda ref: ref[pl.program_id(0)])
    return pl.BlockSpec((1,), lambda b, h, s: (b,)), lambda ref: ref[0]


def _codebook_head(hc: int, hkv: int):
    """Codebook block index of KV head h: its own, or the one shared codebook."""
    return (lambda h: h) if hc == hkv else (lambda h: 0)


def _lut_inputs(q, k_codebook, hkv, sm_scale, rows):
    """(refs, specs) of post-RoPE key scoring: LUT [B, Hkv, G, R, K]."""
    lut = lookup_tables(q[:, None], k_codebook, hkv, sm_scale)  # [B, Hkv, gq, G, K]
    gq = lut.shape[2]
    lut = jnp.pad(lut.transpose(0, 1, 3, 2, 4), ((0, 0),) * 3 + ((0, rows - gq), (0, 0)))
    spec = pl.BlockSpec((None, None) + lut.shape[2:], lambda i, h, j: (i, h, 0, 0, 0))
    return [lut], [spec]


def _scaled_query(q, hkv: int, sm_scale: float):
    """q [B, Hq, D] -> f32 [B, Hkv, gq, D] times sm_scale."""
    b, hq, d = q.shape
    return q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d) * sm_scale


def _rope_query_terms(q, key_rope: KeyRope, hkv: int, sm_scale: float):
    """(A, B [B, Hkv, gq, D], omega [Hkv, D]): the pre-RoPE scoring terms of both bodies."""
    rope = jax.tree.map(lambda x: jnp.broadcast_to(x, (hkv, q.shape[-1])), key_rope)
    a, bt = rope.query_terms(_scaled_query(q, hkv, sm_scale))
    return a, bt, rope.omega


def _rope_inputs(q, k_codebook, key_rope: KeyRope, hkv, sm_scale, rows, gp):
    """(refs, specs) of pre-RoPE key scoring: query terms A, B [B, Hkv, G, R, gp],
    frequencies [Hkv, G, 1, gp] and key centroids [Hc, G, K, gp] (channels padded by 0)."""
    b, hq, _ = q.shape
    hc, n_groups, n_codes, gs = k_codebook.shape
    gq = hq // hkv
    a, bt, omega = _rope_query_terms(q, key_rope, hkv, sm_scale)

    def by_group(x):  # [B, Hkv, gq, D] -> [B, Hkv, G, rows, gp]
        x = x.reshape(b, hkv, gq, n_groups, gs).transpose(0, 1, 3, 2, 4)
        return jnp.pad(x, ((0, 0),) * 3 + ((0, rows - gq), (0, gp - gs)))

    omega = jnp.pad(omega.reshape(hkv, n_groups, 1, gs), ((0, 0),) * 3 + ((0, gp - gs),))
    kcb = jnp.pad(k_codebook.astype(jnp.float32), ((0, 0),) * 3 + ((0, gp - gs),))
    cb_head = _codebook_head(hc, hkv)
    q_spec = pl.BlockSpec((None, None, n_groups, rows, gp), lambda i, h, j: (i, h, 0, 0, 0))
    specs = [q_spec, q_spec,
             pl.BlockSpec((None, n_groups, 1, gp), lambda i, h, j: (h, 0, 0, 0)),
             pl.BlockSpec((None, n_groups, n_codes, gp), lambda i, h, j: (cb_head(h), 0, 0, 0))]
    return [by_group(a), by_group(bt), omega, kcb], specs


def _gather_body(q, k_codebook, v_codebook, key_rope, hkv, sm_scale, rows, n_splits, loop):
    """GPU body: (kernel, (inputs, specs) before and after the codes, output spec and
    shape [B, Hkv, N, R, Dp])."""
    b, _, d = q.shape
    _, n_groups, n_codes, gs = k_codebook.shape
    width = _next_pow2(d, 16)
    query, query_specs, tables, table_specs = _gather_inputs(
        q, k_codebook, v_codebook, key_rope, hkv, sm_scale, rows, width)
    kernel = functools.partial(_vq_gather_kernel, rope=key_rope is not None,
                               n_groups=n_groups, n_codes=n_codes, gs=gs, **loop)
    o_spec = pl.BlockSpec((None, None, None, rows, width), lambda i, h, j: (i, h, j, 0, 0))
    return (kernel, (query, query_specs), (tables, table_specs), o_spec,
            (b, hkv, n_splits, rows, width))


def _one_hot_body(q, k_codebook, v_codebook, key_rope, hkv, sm_scale, rows, n_splits, loop):
    """TPU body: as `_gather_body`; output [B, Hkv, N, G, R, gp]."""
    b = q.shape[0]
    hc, n_groups, n_codes, gs = v_codebook.shape
    gp = _next_pow2(gs, 16)
    if key_rope is None:
        key_inputs, key_specs = _lut_inputs(q, k_codebook, hkv, sm_scale, rows)
        key_scores = _lut_scores
    else:
        key_inputs, key_specs = _rope_inputs(q, k_codebook, key_rope, hkv, sm_scale, rows, gp)
        key_scores = _rope_scores
    vcb = jnp.pad(v_codebook.astype(jnp.float32), ((0, 0),) * 3 + ((0, gp - gs),))
    cb_head = _codebook_head(hc, hkv)
    vcb_spec = pl.BlockSpec((None, n_groups, n_codes, gp), lambda i, h, j: (cb_head(h), 0, 0, 0))
    kernel = functools.partial(_vq_decode_kernel, key_scores=key_scores,
                               n_key_refs=len(key_inputs), **loop)
    o_spec = pl.BlockSpec((None, None, None, n_groups, rows, gp),
                          lambda i, h, j: (i, h, j, 0, 0, 0))
    return (kernel, (key_inputs, key_specs), ([vcb], [vcb_spec]), o_spec,
            (b, hkv, n_splits, n_groups, rows, gp))


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret", "backend",
                                             "sm_scale"))
def vq_decode_attention_pallas(q, k_codes, v_codes, k_codebook, v_codebook, lengths,
                               key_rope: KeyRope | None = None, *,
                               block_sizes: BlockSizes = BlockSizes(), interpret: bool = False,
                               backend: str = "triton", sm_scale: float | None = None):
    """Decode attention [B, Hq, D] over codes; arguments as in `api.vq_decode_attention`
    (which validates them). `key_rope`: keys were coded before RoPE (slot = position)."""
    b, hq, d = q.shape
    _, hkv, n_groups, s = k_codes.shape
    gs = v_codebook.shape[3]
    gq = hq // hkv
    if backend == "triton" and not interpret and (
            n_groups & (n_groups - 1) or gs & (gs - 1) or d < 16):
        raise ValueError(f"the compiled Triton kernel needs power-of-two code groups and group "
                         f"size (Triton tensors are powers of two) and head_dim >= 16 (dot "
                         f"tiles), got G={n_groups}, group size {gs}, head_dim {d}")
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    rows = _next_pow2(gq, 16)  # Triton dots need dims >= 16
    bkv = min(block_sizes.block_kv, _next_pow2(s, 16))
    bps = min(block_sizes.blocks_per_split, pl.cdiv(s, bkv))
    split_len = bkv * bps
    n_splits = pl.cdiv(s, split_len)
    pad_s = n_splits * split_len - s
    k_codes = jnp.pad(k_codes, ((0, 0),) * 3 + ((0, pad_s),))
    v_codes = jnp.pad(v_codes, ((0, 0),) * 3 + ((0, pad_s),))
    len_spec, read_length = _lengths_spec(backend)
    code_spec = pl.BlockSpec((None, None, n_groups, split_len), lambda i, h, j: (i, h, 0, j))
    stats_spec = pl.BlockSpec((None, None, None, rows, 1), lambda i, h, j: (i, h, j, 0, 0))
    stats_shape = jax.ShapeDtypeStruct((b, hkv, n_splits, rows, 1), jnp.float32)
    loop = dict(block_kv=bkv, blocks_per_split=bps, read_length=read_length,
                precision=_PRECISIONS[block_sizes.precision])
    body = _gather_body if backend == "triton" else _one_hot_body
    kernel, (before, before_specs), (after, after_specs), o_spec, o_shape = body(
        q, k_codebook, v_codebook, key_rope, hkv, sm_scale, rows, n_splits, loop)

    o, m, l = pl.pallas_call(
        kernel,
        grid=(b, hkv, n_splits),
        in_specs=[len_spec, *before_specs, code_spec, code_spec, *after_specs],
        out_specs=[o_spec, stats_spec, stats_spec],
        out_shape=[jax.ShapeDtypeStruct(o_shape, jnp.float32), stats_shape, stats_shape],
        compiler_params=_compiler_params(backend),
        interpret=interpret,
        name="vq_decode_attention" if key_rope is None else "vq_rope_decode_attention",
    )(lengths.astype(jnp.int32), *before, k_codes, v_codes, *after)
    if backend == "triton":  # one [R, Dp] partial per split: a single "group" of Dp channels
        out = merge_splits(o[:, :, :, None], m, l, gq, o.shape[-1])[..., :d]
    else:
        out = merge_splits(o, m, l, gq, gs)
    return out.reshape(b, hq, d).astype(q.dtype)


def merge_splits(o, m, l, gq: int, gs: int):
    """Combine split partials: o [B, Hkv, N, G, R, gp], m/l [B, Hkv, N, R, 1] -> [B, Hkv, gq, D].

    Splits past a row's length carry m = _MASKED and l = 0, so their weight is exactly 0;
    a row with no tokens at all gives zeros (as the reference does)."""
    m_all = jnp.max(m, axis=2, keepdims=True)
    corr = jnp.exp(m - m_all)  # [B, Hkv, N, R, 1]
    l_all = jnp.sum(corr * l, axis=2)  # [B, Hkv, R, 1]
    o_all = jnp.sum(corr[:, :, :, None] * o, axis=2)  # [B, Hkv, G, R, gp]
    o_all = o_all / jnp.maximum(l_all, jnp.finfo(jnp.float32).tiny)[:, :, None]
    o_all = o_all[:, :, :, :gq, :gs]  # drop padded rows / channels
    bb, hkv, g = o_all.shape[:3]
    return o_all.transpose(0, 1, 3, 2, 4).reshape(bb, hkv, gq, g * gs)
