"""Reference masked GQA attention: the oracle every cache layout and kernel is checked against."""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def attention_mask(q_pos: Int[Array, "B T"], kv_pos: Int[Array, "B S"],
                   kv_valid: Bool[Array, "B S"], window: int | None) -> Bool[Array, "B T S"]:
    """Causal (kv_pos <= q_pos), optionally windowed (q_pos - kv_pos < window), valid slots."""
    qp, kp = q_pos[:, :, None], kv_pos[:, None, :]
    mask = kv_valid[:, None, :] & (kp <= qp)
    if window is not None:
        mask &= qp - kp < window
    return mask


def masked_softmax_weights(scores: Float[Array, "... S"], mask: Bool[Array, "... S"]) -> Array:
    """Softmax over the masked entries; an all-masked row gives all-zero weights, not NaN."""
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
    return p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), jnp.finfo(p.dtype).tiny)


def gqa_scores(q: Float[Array, "B T Hq D"], k: Float[Array, "B S Hkv D"]) -> Array:
    """Scaled q.k scores [B, Hkv, G, T, S] in f32 (G = query heads per KV head)."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d).astype(jnp.float32)
    return jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) / jnp.sqrt(d)


def attend(q: Float[Array, "B T Hq D"], k: Float[Array, "B S Hkv D"],
           v: Float[Array, "B S Hkv D"], q_pos: Int[Array, "B T"], kv_pos: Int[Array, "B S"],
           kv_valid: Bool[Array, "B S"], window: int | None = None) -> Float[Array, "B T Hq D"]:
    """Masked grouped-query attention; returns in q's dtype."""
    b, t, hq, d = q.shape
    mask = attention_mask(q_pos, kv_pos, kv_valid, window)[:, None, None]  # [B,1,1,T,S]
    w = masked_softmax_weights(gqa_scores(q, k), mask)
    out = jnp.einsum("bkgts,bskd->btkgd", w, v.astype(jnp.float32))
    return out.reshape(b, t, hq, d).astype(q.dtype)
