"""Plain-JAX attention that reads vector-quantised K/V codes directly (the oracle).

Layout shared by the cache codec (research/kv/vq.py), this reference and the Pallas
kernel:

    codes     uint8 [B, Hkv, G, S]   one code per (token, KV head, channel group); the group
                                      axis comes before the context axis so that each group's
                                      codes are a contiguous run of S bytes (XLA:CPU gathers
                                      and scatters over such runs vectorise; the transposed
                                      [S, G] layout was measured ~5x slower).
    codebook  f32   [Hc, G, K, g]    K centroids of g channels per group; Hc is 1 (shared by
                                      all KV heads) or Hkv.
    q         [B, T, Hq, D]          queries in the codec's channel order, D = G * g.

Keys are never rebuilt: a per-query lookup table LUT[g, k] = q_g . centroid_k (one row of
K entries per group) turns each key score into G table reads. Values are never rebuilt
either: per group the softmax weights are summed into K per-code bins (a segment sum), and
the bins are multiplied by the centroid table once.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, UInt8

from research.model.attention import masked_softmax_weights


def _codebook_for_heads(codebook: Array, n_kv_heads: int) -> Array:
    """[Hc, G, K, g] -> [Hkv, G, K, g] (a shared codebook serves every head)."""
    return jnp.broadcast_to(codebook, (n_kv_heads,) + codebook.shape[1:])


def lookup_tables(q: Float[Array, "B T Hq D"], k_codebook: Float[Array, "Hc G K g"],
                  n_kv_heads: int, sm_scale: float) -> Float[Array, "B Hkv R G K"]:
    """Per-query tables: LUT[b, h, r, g, k] = sm_scale * q_g . centroid_{h,g,k}.

    Rows r enumerate (t, query head of the KV group) as r = t * (Hq / Hkv) + j.
    """
    b, t, hq, d = q.shape
    hc, g, kk, gs = k_codebook.shape
    qg = q.astype(jnp.float32).reshape(b, t, n_kv_heads, hq // n_kv_heads, g, gs)
    cb = _codebook_for_heads(k_codebook.astype(jnp.float32), n_kv_heads)
    lut = jnp.einsum("bthjgc,hgkc->bhtjgk", qg, cb) * sm_scale
    return lut.reshape(b, n_kv_heads, t * (hq // n_kv_heads), g, kk)


def scores_from_codes(lut: Float[Array, "R G K"], codes: UInt8[Array, "G S"]) -> Array:
    """score[r, s] = sum_g LUT[r, g, codes[g, s]]  ->  [R, S]."""
    idx = codes.astype(jnp.int32)
    total = jnp.take(lut[:, 0, :], idx[0], axis=1)
    for g in range(1, codes.shape[0]):
        total = total + jnp.take(lut[:, g, :], idx[g], axis=1)
    return total


def values_from_codes(weights: Float[Array, "R S"], codes: UInt8[Array, "G S"],
                      codebook: Float[Array, "G K g"]) -> Float[Array, "R D"]:
    """out[r] = sum_s w[r, s] * centroid(codes[:, s]) via per-code bins, never rebuilding V."""
    n_codes = codebook.shape[1]
    wt = weights.T  # [S, R]: segment_sum reduces over the leading axis
    outs = []
    for g in range(codes.shape[0]):
        bins = jax.ops.segment_sum(wt, codes[g].astype(jnp.int32), num_segments=n_codes)
        outs.append(bins.T @ codebook[g].astype(jnp.float32))  # [R, K] @ [K, g]
    return jnp.concatenate(outs, axis=-1)


def vq_attention_reference(q: Float[Array, "B T Hq D"], k_codes: UInt8[Array, "B Hkv G S"],
                           v_codes: UInt8[Array, "B Hkv G S"],
                           k_codebook: Float[Array, "Hc G K g"],
                           v_codebook: Float[Array, "Hc G K g"],
                           mask: Bool[Array, "B T S"],
                           sm_scale: float | None = None) -> Float[Array, "B T Hq D"]:
    """Masked GQA attention of `q` over coded K/V; f32 output. All-masked rows give zeros."""
    b, t, hq, d = q.shape
    hkv = k_codes.shape[1]
    gq = hq // hkv
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    lut = lookup_tables(q, k_codebook, hkv, sm_scale)  # [B, Hkv, R, G, K]
    vcb = _codebook_for_heads(v_codebook, hkv)
    row_mask = jnp.repeat(mask, gq, axis=1)  # [B, R, S], rows r = t * gq + j

    def one_head(lut_bh, kc_bh, vc_bh, vcb_h, mask_b):
        w = masked_softmax_weights(scores_from_codes(lut_bh, kc_bh), mask_b)
        return values_from_codes(w, vc_bh, vcb_h)  # [R, D]

    per_head = jax.vmap(one_head, in_axes=(0, 0, 0, 0, None))  # over KV heads
    out = jax.vmap(per_head, in_axes=(0, 0, 0, None, 0))(lut, k_codes, v_codes, vcb, row_mask)
    # out: [B, Hkv, T * gq, D] -> [B, T, Hq, D]
    out = out.reshape(b, hkv, t, gq, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, hq, d)


def vq_decode_attention_reference(q: Float[Array, "B Hq D"], k_codes: UInt8[Array, "B Hkv G S"],
                                  v_codes: UInt8[Array, "B Hkv G S"],
                                  k_codebook: Float[Array, "Hc G K g"],
                                  v_codebook: Float[Array, "Hc G K g"],
                                  lengths: Int[Array, "B"],
                                  sm_scale: float | None = None) -> Float[Array, "B Hq D"]:
    """One decode query per row over its first `lengths[b]` cached tokens (the kernel's oracle)."""
    s = k_codes.shape[-1]
    mask = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, :]  # [B, 1, S]
    return vq_attention_reference(q[:, None], k_codes, v_codes, k_codebook, v_codebook, mask,
                                  sm_scale)[:, 0]


def dequantize(codes: UInt8[Array, "B Hkv G S"], codebook: Float[Array, "Hc G K g"]
               ) -> Float[Array, "B S Hkv D"]:
    """Dense K or V rebuilt from codes. For tests and baselines only: the attention above
    never calls it."""
    b, hkv, g, s = codes.shape
    cb = _codebook_for_heads(codebook.astype(jnp.float32), hkv)  # [Hkv, G, K, gs]
    h_idx = jnp.arange(hkv)[None, :, None, None]
    g_idx = jnp.arange(g)[None, None, :, None]
    vals = cb[h_idx, g_idx, codes.astype(jnp.int32)]  # [B, Hkv, G, S, gs]
    return vals.transpose(0, 3, 1, 2, 4).reshape(b, s, hkv, g * cb.shape[-1])
