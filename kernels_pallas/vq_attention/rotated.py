"""Pre-RoPE key codes scored through one rotated lookup table per query (no key rebuild).

RoPE (half-split pairing: channel i rotates with i + D/2) multiplies each pair of a
pre-RoPE key, read as the complex number z_j = k[j] + i k[j + D/2], by e^{i theta_j p}.
With w_j = q[j] + i q[j + D/2] the score is

    q . RoPE_p(k) = Re sum_j conj(w_j) z_j e^{i theta_j p}.

When every code group holds whole RoPE pairs, a group's code fixes its pairs' z_j (the
centroid's channels), so the complex products T[g, code, j] = conj(w_j) c_{g,code,j} form
one table per query (K entries of P = g/2 pairs per group), like the post-RoPE lookup
table, and a token's score is

    score(p) = sum_g sum_{j in g} Re T[g, code_g, j] cos(theta_j p)
                                  - Im T[g, code_g, j] sin(theta_j p):

a table read per group and one multiply-add per pair with the position's cos/sin (shared
by every row, head and layer). A 2-D centroid per pair is a complex number, and complex
multiplication commutes, so any pre-RoPE codebook "commutes with RoPE" here (CommVQ's
scaled-rotation codebooks are the matrix form of the same fact): the table needs no
special codebook, only pair-aligned groups. Per token and query row that is 2 * D/2 table
entries and D multiply-adds, against G entries and G adds for post-RoPE codes and a
rebuilt [D] key, two [D] rotations and a D-long dot for the rebuild (see
`vq_attention_blockwise(..., key_rope=...)`).

Measured on XLA:CPU (scripts/bench_vq_key_reads_cpu.py, one SmolLM2 layer, batch 4 x 8k,
2 shared cores): the rotated read is no faster than the rebuild (19.4 vs 18.5 ms and 32.8
vs 26.5 ms in two runs; post-RoPE tables 7-11 ms, bf16 31-37 ms). Per token and KV head
it does ~2.7x fewer multiply-adds (3 x 64 against 128 + 3 x 128) but gathers 3x more
table floats (8 rows of 3 x 8 against 8 centroids of 8), and XLA:CPU's gathers, not the
rebuild's small dense dots, are what the time goes to. The table rows fit where a
kernel keeps them on chip (TPU VMEM, GPU shared memory), where the trade can differ.

Layouts as in reference.py: codes [B, S, Hkv, G] uint8 with slot s at position s,
codebooks [Hc, G, K, g], queries in the codec's channel order (perm [Hkv, D]: codec
channel c of head h is model channel perm[h, c]).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int, UInt8

from kernels_pallas.paged_attention.reference import gather_sequences, mapped_tokens
from kernels_pallas.vq_attention.reference import _codebook_for_heads, values_from_codes
from research.core.attention import masked_softmax_weights


def pair_aligned(perm, group_size: int) -> bool:
    """Whether every run of `group_size` codec channels of every row of `perm` [H, D]
    holds whole RoPE pairs (i, i + D/2) (concrete arrays only)."""
    perm = np.asarray(perm)
    h, d = perm.shape
    if d % 2 or group_size % 2 or d % group_size:
        return False
    groups = np.sort(perm.reshape(h, d // group_size, group_size), axis=-1)
    half, p = d // 2, group_size // 2
    return bool((groups[..., p:] == groups[..., :p] + half).all())


def pair_aligned_order(head_dim: int, group_size: int) -> np.ndarray:
    """The codec channel order [D] nearest the identity whose groups hold whole pairs:
    group k holds pairs k*P .. k*P + P - 1 (P = group_size / 2), real channels first."""
    if head_dim % group_size or group_size % 2:
        raise ValueError(f"group_size={group_size} must be even and divide "
                         f"head_dim={head_dim}")
    half, p = head_dim // 2, group_size // 2
    pairs = np.arange(half).reshape(-1, p)
    return np.concatenate([pairs, pairs + half], axis=1).reshape(-1).astype(np.int32)


@struct.dataclass
class PairTables:
    """Where each group's RoPE pairs sit, per KV head: [H, G, P] each (P = g / 2).

    re_pos / im_pos: position inside the group of the pair's real (model channel j < D/2)
    and imaginary (j + D/2) channel; omega: the pair's RoPE frequency."""

    re_pos: Array
    im_pos: Array
    omega: Array

    @classmethod
    def from_permutation(cls, perm: Int[Array, "H D"], group_size: int,
                         theta: float) -> "PairTables":
        """Tables of codec channel order `perm` cut into groups of `group_size`. Pure jnp
        (a codec derives them from its traced permutation inside jit); a concrete `perm`
        whose groups split a RoPE pair raises."""
        perm = jnp.asarray(perm)
        if perm.ndim != 2 or perm.shape[1] % group_size or group_size % 2:
            raise ValueError(f"perm must be [H, D] with D a multiple of an even group_size, "
                             f"got {perm.shape} and group_size={group_size}")
        if not isinstance(perm, jax.core.Tracer) and not pair_aligned(perm, group_size):
            raise ValueError(f"every group of {group_size} codec channels must hold whole "
                             "RoPE pairs (i, i + D/2) for the rotated-table read; got a "
                             "key permutation that splits a pair")
        h, d = perm.shape
        p = group_size // 2
        grouped = perm.reshape(h, d // group_size, group_size)
        order = jnp.argsort(grouped, axis=-1).astype(jnp.int32)  # real channels sort first
        re_pos, im_pos = order[..., :p], order[..., p:]
        pair = jnp.take_along_axis(grouped, re_pos, axis=-1)  # model pair index j < D/2
        # the same f32 ops as research.core.rope.rope_angles (bit-identical frequencies)
        inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
        return cls(re_pos, im_pos, inv_freq[pair])

    def cos_sin(self, positions: Int[Array, "S"]) -> Float[Array, "S H G X"]:
        """[cos | sin] of each pair's angle at `positions`, X = 2P (cos of the P pairs,
        then their sin). Angles are the f32 products position x frequency, as the model's
        RoPE computes them, so long-context angles round exactly as the model's do."""
        ang = positions.astype(jnp.float32)[:, None, None, None] * self.omega[None]
        return jnp.concatenate([jnp.cos(ang), jnp.sin(ang)], axis=-1)

    def shifted(self, local: Float[Array, "S H G X"], origin) -> Float[Array, "S H G X"]:
        """`cos_sin(origin + j)` from `local = cos_sin(j)` by angle addition (4 multiply-
        adds per entry instead of two transcendentals: a reader computes `local` once for
        a block's offsets and shifts it to each block's origin). The angles round as
        fl(origin * omega) + fl(j * omega), not fl((origin + j) * omega): a difference of
        order |p omega| 2^-24 radians (~5e-4 at p = 8k, omega = 1), the same as the
        rebuild reader's block-origin rotation (rope.KeyRope.query_terms)."""
        p = self.omega.shape[-1]
        at = self.cos_sin(jnp.asarray(origin)[None])[0]  # [H, G, X]
        co, so, cj, sj = at[..., :p], at[..., p:], local[..., :p], local[..., p:]
        return jnp.concatenate([co * cj - so * sj, so * cj + co * sj], axis=-1)


def rotated_tables(q: Float[Array, "B T Hq D"], k_codebook: Float[Array, "Hc G K g"],
                   pairs: PairTables, sm_scale: float) -> Float[Array, "B Hkv G K R X"]:
    """Per-query tables: [Re T | -Im T] with T[.., g, k, r, m] = sm_scale conj(w) c for
    pair m of group g, centroid k, query row r = t * (Hq / Hkv) + j (X = 2P), so that a
    token's score is the dot of its table rows with `PairTables.cos_sin`."""
    b, t, hq, d = q.shape
    hkv, g, p = pairs.re_pos.shape
    gs = 2 * p
    qg = q.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, g, gs) * sm_scale
    qg = qg.transpose(0, 2, 4, 1, 3, 5).reshape(b, hkv, g, t * (hq // hkv), gs)  # [B,H,G,R,g]
    w_re = jnp.take_along_axis(qg, pairs.re_pos[None, :, :, None, :], axis=-1)  # [B,H,G,R,P]
    w_im = jnp.take_along_axis(qg, pairs.im_pos[None, :, :, None, :], axis=-1)
    cb = _codebook_for_heads(k_codebook.astype(jnp.float32), hkv)  # [H, G, K, g]
    c_re = jnp.take_along_axis(cb, pairs.re_pos[:, :, None, :], axis=-1)  # [H, G, K, P]
    c_im = jnp.take_along_axis(cb, pairs.im_pos[:, :, None, :], axis=-1)

    def prod(w, c):  # [B, H, G, R, P] x [H, G, K, P] -> [B, H, G, K, R, P]
        return w[:, :, :, None] * c[None, :, :, :, None]

    re = prod(w_re, c_re) + prod(w_im, c_im)
    neg_im = prod(w_im, c_re) - prod(w_re, c_im)
    return jnp.concatenate([re, neg_im], axis=-1)


def rotated_scores(tables: Float[Array, "B Hkv G K R X"], codes: UInt8[Array, "B S Hkv G"],
                   cos_sin: Float[Array, "S Hkv G X"]) -> Float[Array, "B Hkv R S"]:
    """score[b, h, r, s] = sum_g tables[b, h, g, codes[b, s, h, g], r] . cos_sin[s, h, g]:
    one flat row gather per (token, head, group), no key rebuilt."""
    b, hkv, g, k, r, x = tables.shape
    flat = tables.reshape(b, hkv * g * k, r * x)
    first = (jnp.arange(hkv)[:, None] * g + jnp.arange(g)[None, :]) * k  # [H, G]
    idx = first[None, None] + codes.astype(jnp.int32)  # [B, S, H, G]
    rows = jax.vmap(lambda tab, i: jnp.take(tab, i, axis=0))(flat, idx)  # [B, S, H, G, R*X]
    rows = rows.reshape(rows.shape[:4] + (r, x))
    return jnp.einsum("bshgrx,shgx->bhrs", rows, cos_sin)


def vq_attention_rotated(q: Float[Array, "B T Hq D"], k_codes: UInt8[Array, "B S Hkv G"],
                         v_codes: UInt8[Array, "B S Hkv G"],
                         k_codebook: Float[Array, "Hc G K g"],
                         v_codebook: Float[Array, "Hc G K g"],
                         mask: Bool[Array, "B T S"], pairs: PairTables, block: int = 512,
                         sm_scale: float | None = None) -> Float[Array, "B T Hq D"]:
    """Masked GQA attention over pre-RoPE key codes (slot s at position s) through rotated
    per-query tables; values through per-code bins (reference.values_from_codes). Keys
    are scored `block` slots at a time (at most one block of gathered table rows exists),
    with cos/sin of the block's offsets computed once and shifted to each block's origin
    (`PairTables.shifted`: on XLA:CPU exact per-position cos/sin cost ~40% of the read at
    8k); f32 output, all-masked rows give zeros."""
    b, t, hq, d = q.shape
    _, s, hkv, g = k_codes.shape
    gq = hq // hkv
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    tables = rotated_tables(q, k_codebook, pairs, sm_scale)  # [B, H, G, K, R, X]
    block = min(block, s)
    n_blocks = -(-s // block)
    codes = jnp.pad(k_codes, ((0, 0), (0, n_blocks * block - s), (0, 0), (0, 0)))
    codes = jnp.moveaxis(codes.reshape(b, n_blocks, block, hkv, g), 1, 0)
    local = pairs.cos_sin(jnp.arange(block))  # block-local offsets, once

    def block_scores(xs):  # -> [B, H, R, block]
        block_codes, i = xs
        return rotated_scores(tables, block_codes, pairs.shifted(local, i * block))

    scores = jax.lax.map(block_scores, (codes, jnp.arange(n_blocks)))  # [n, B, H, R, blk]
    scores = jnp.moveaxis(scores, 0, 3).reshape(b, hkv, t * gq, n_blocks * block)[..., :s]
    row_mask = jnp.repeat(mask, gq, axis=1)[:, None]  # [B, 1, R, S], rows r = t * gq + j
    weights = masked_softmax_weights(scores, row_mask)  # [B, H, R, S]
    vcb = _codebook_for_heads(v_codebook, hkv)
    per_head = jax.vmap(values_from_codes, in_axes=(0, 1, 0))  # over KV heads
    out = jax.vmap(per_head, in_axes=(0, 0, None))(weights, v_codes, vcb)  # [B, H, R, D]
    out = out.reshape(b, hkv, t, gq, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, hq, d)


def vq_decode_attention_rotated(q: Float[Array, "B Hq D"], k_codes: UInt8[Array, "B S Hkv G"],
                                v_codes: UInt8[Array, "B S Hkv G"],
                                k_codebook: Float[Array, "Hc G K g"],
                                v_codebook: Float[Array, "Hc G K g"],
                                lengths: Int[Array, "B"], pairs: PairTables,
                                block: int = 512, sm_scale: float | None = None,
                                kv_valid: Bool[Array, "B S"] | None = None
                                ) -> Float[Array, "B Hq D"]:
    """One decode query per row over its first `lengths[b]` slots (and `kv_valid`)."""
    mask = jnp.arange(k_codes.shape[1])[None, :] < lengths[:, None]
    if kv_valid is not None:
        mask &= kv_valid
    return vq_attention_rotated(q[:, None], k_codes, v_codes, k_codebook, v_codebook,
                                mask[:, None], pairs, block, sm_scale)[:, 0]


def vq_decode_attention_rotated_paged(q: Float[Array, "B Hq D"],
                                      k_pages: UInt8[Array, "N P Hkv G"],
                                      v_pages: UInt8[Array, "N P Hkv G"],
                                      k_codebook: Float[Array, "Hc G K g"],
                                      v_codebook: Float[Array, "Hc G K g"],
                                      block_table: Int[Array, "B M"], lengths: Int[Array, "B"],
                                      pairs: PairTables, block: int = 512,
                                      sm_scale: float | None = None) -> Float[Array, "B Hq D"]:
    """The same over codes in pages read through `block_table` (-1 = unmapped, masked):
    row b's slot m * P + j is page block_table[b, m]'s token j, at position m * P + j."""
    k_codes = gather_sequences(k_pages, block_table)
    v_codes = gather_sequences(v_pages, block_table)
    return vq_decode_attention_rotated(q, k_codes, v_codes, k_codebook, v_codebook, lengths,
                                       pairs, block, sm_scale,
                                       kv_valid=mapped_tokens(block_table, k_pages.shape[1]))
