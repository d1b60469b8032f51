"""Pallas decode attention over VQ codes (GQA), split-K ("flash decoding") schedule.

Grid (batch, KV head, context split). Each program walks its split in blocks of
`block_kv` tokens with an online softmax and writes an unnormalised partial output plus
its running max and sum; the wrapper merges the splits (log-sum-exp), as jax's GPU
`decode_attention` does. The splits are independent, so the same body runs on Triton
(where grid programs run in parallel and cannot accumulate across the grid) and on
Mosaic TPU.

Gathers are not portable (Mosaic and Triton reject them), so codes are read through
one-hot matmuls: per group g, onehot[k, t] = (code[g, t] == k), then
    scores += LUT_g [rows, K] @ onehot [K, t]          (key scores from the lookup table)
    bins    = p [rows, t] @ onehot^T [t, K]            (softmax weights binned per code)
    acc_g   = corr * acc_g + bins @ centroids_g [K, g] (values, never rebuilt per token)
This costs ~K/g times the FLOPs of dense attention (it trades bytes for MXU/tensor-core
work); see experiments/tasq/README.md for what that means on each backend.

Keys coded before RoPE (`key_rope`) cannot use a lookup table; each group's block of keys
is rebuilt in registers/VMEM (keys_g = onehot^T @ centroids_g [t, g]) and scored at its
positions with the rotation moved onto the query (rope.KeyRope.query_terms):
    scores += A_g @ (keys_g * cos(omega_g p))^T + B_g @ (keys_g * sin(omega_g p))^T
Only codes cross HBM; dense keys exist one block and one group at a time.
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
_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Context tokens per inner step and inner steps per grid program.

    Each step builds [K, block_kv] one-hot tiles per group: 512 suits TPU VMEM; on GPU
    (Triton keeps tiles in registers) use ~64 and more blocks per split.
    """

    block_kv: int = 512
    blocks_per_split: int = 8

    def __post_init__(self):
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


def _lut_scores(key_refs, kc_ref, start, code_ids, split_start):
    """Post-RoPE codes: scores [R, block_kv] = sum_g LUT_g @ onehot_g."""
    del split_start  # post-RoPE scores do not depend on position
    (lut_ref,) = key_refs
    s = jnp.zeros((lut_ref.shape[1], code_ids.shape[1]), jnp.float32)
    for g in range(lut_ref.shape[0]):
        s += jnp.dot(lut_ref[g], _one_hot(kc_ref, g, start, code_ids), precision=_HIGHEST)
    return s


def _rope_scores(key_refs, kc_ref, start, code_ids, split_start):
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
                                   (((0,), (0,)), ((), ())), precision=_HIGHEST)
        ang = pos * omega_ref[g]  # [block_kv, gp]
        s += jax.lax.dot_general(a_ref[g], keys * jnp.cos(ang), contract_last,
                                 precision=_HIGHEST)
        s += jax.lax.dot_general(b_ref[g], keys * jnp.sin(ang), contract_last,
                                 precision=_HIGHEST)
    return s


def _vq_decode_kernel(len_ref, *refs, key_scores, n_key_refs: int, block_kv: int,
                      blocks_per_split: int, read_length):
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
        s = key_scores(key_refs, kc_ref, start, code_ids, split_start)
        pos = split_start + start + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        s = jnp.where(pos < length, s, _MASKED)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        corr = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next)  # masked entries underflow to exactly 0
        l_next = corr * l_prev + jnp.sum(p, axis=1, keepdims=True)
        new_acc = []
        for g in range(n_groups):
            bins = jax.lax.dot_general(p, _one_hot(vc_ref, g, start, code_ids),
                                       (((1,), (1,)), ((), ())), precision=_HIGHEST)  # [R, K]
            new_acc.append(corr * acc[g] + jnp.dot(bins, vcb_ref[g], precision=_HIGHEST))
        return m_next, l_next, tuple(new_acc)

    init = (jnp.full((rows, 1), _MASKED, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            tuple(jnp.zeros((rows, gp), jnp.float32) for _ in range(n_groups)))
    m, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    for g in range(n_groups):
        o_ref[g] = acc[g]
    m_ref[...] = m
    l_ref[...] = l


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


def _rope_inputs(q, k_codebook, key_rope: KeyRope, hkv, sm_scale, rows, gp):
    """(refs, specs) of pre-RoPE key scoring: query terms A, B [B, Hkv, G, R, gp],
    frequencies [Hkv, G, 1, gp] and key centroids [Hc, G, K, gp] (channels padded by 0)."""
    b, hq, d = q.shape
    hc, n_groups, n_codes, gs = k_codebook.shape
    gq = hq // hkv
    rope = jax.tree.map(lambda x: jnp.broadcast_to(x, (hkv, d)), key_rope)
    a, bt = rope.query_terms(q.astype(jnp.float32).reshape(b, hkv, gq, d) * sm_scale)

    def by_group(x):  # [B, Hkv, gq, D] -> [B, Hkv, G, rows, gp]
        x = x.reshape(b, hkv, gq, n_groups, gs).transpose(0, 1, 3, 2, 4)
        return jnp.pad(x, ((0, 0),) * 3 + ((0, rows - gq), (0, gp - gs)))

    omega = jnp.pad(rope.omega.reshape(hkv, n_groups, 1, gs), ((0, 0),) * 3 + ((0, gp - gs),))
    kcb = jnp.pad(k_codebook.astype(jnp.float32), ((0, 0),) * 3 + ((0, gp - gs),))
    cb_head = _codebook_head(hc, hkv)
    q_spec = pl.BlockSpec((None, None, n_groups, rows, gp), lambda i, h, j: (i, h, 0, 0, 0))
    specs = [q_spec, q_spec,
             pl.BlockSpec((None, n_groups, 1, gp), lambda i, h, j: (h, 0, 0, 0)),
             pl.BlockSpec((None, n_groups, n_codes, gp), lambda i, h, j: (cb_head(h), 0, 0, 0))]
    return [by_group(a), by_group(bt), omega, kcb], specs


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
    hc, _, n_codes, gs = v_codebook.shape
    gq = hq // hkv
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    rows, gp = _next_pow2(gq, 16), _next_pow2(gs, 16)  # Triton dots need dims >= 16
    bkv = min(block_sizes.block_kv, _next_pow2(s, 16))
    bps = min(block_sizes.blocks_per_split, pl.cdiv(s, bkv))
    split_len = bkv * bps
    n_splits = pl.cdiv(s, split_len)
    pad_s = n_splits * split_len - s

    if key_rope is None:
        key_inputs, key_specs = _lut_inputs(q, k_codebook, hkv, sm_scale, rows)
        key_scores = _lut_scores
    else:
        key_inputs, key_specs = _rope_inputs(q, k_codebook, key_rope, hkv, sm_scale, rows, gp)
        key_scores = _rope_scores
    k_codes = jnp.pad(k_codes, ((0, 0),) * 3 + ((0, pad_s),))
    v_codes = jnp.pad(v_codes, ((0, 0),) * 3 + ((0, pad_s),))
    vcb = jnp.pad(v_codebook.astype(jnp.float32), ((0, 0),) * 3 + ((0, gp - gs),))
    cb_head = _codebook_head(hc, hkv)
    len_spec, read_length = _lengths_spec(backend)

    kernel = functools.partial(_vq_decode_kernel, key_scores=key_scores,
                               n_key_refs=len(key_inputs), block_kv=bkv,
                               blocks_per_split=bps, read_length=read_length)
    code_spec = pl.BlockSpec((None, None, n_groups, split_len), lambda i, h, j: (i, h, 0, j))
    o, m, l = pl.pallas_call(
        kernel,
        grid=(b, hkv, n_splits),
        in_specs=[len_spec, *key_specs, code_spec, code_spec,
                  pl.BlockSpec((None, n_groups, n_codes, gp),
                               lambda i, h, j: (cb_head(h), 0, 0, 0))],
        out_specs=[
            pl.BlockSpec((None, None, None, n_groups, rows, gp),
                         lambda i, h, j: (i, h, j, 0, 0, 0)),
            pl.BlockSpec((None, None, None, rows, 1), lambda i, h, j: (i, h, j, 0, 0)),
            pl.BlockSpec((None, None, None, rows, 1), lambda i, h, j: (i, h, j, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, n_splits, n_groups, rows, gp), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, n_splits, rows, 1), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, n_splits, rows, 1), jnp.float32),
        ],
        compiler_params=_compiler_params(backend),
        interpret=interpret,
        name="vq_decode_attention" if key_rope is None else "vq_rope_decode_attention",
    )(lengths.astype(jnp.int32), *key_inputs, k_codes, v_codes, vcb)
    return merge_splits(o, m, l, gq, gs).reshape(b, hq, d).astype(q.dtype)


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
