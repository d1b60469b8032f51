"""Reference masked GQA attention: the oracle every cache layout and kernel is checked against."""
from __future__ import annotations

import functools

import jax
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


def attention_partial(q: Float[Array, "B T Hq D"], k: Float[Array, "B S Hkv D"],
                      v: Float[Array, "B S Hkv D"], mask: Bool[Array, "B T S"],
                      block: int = 512) -> tuple[Array, Array, Array]:
    """Unnormalised masked GQA attention over `block` slots at a time (an online softmax,
    so no [T, S] score matrix exists at once): (row max m, sum l of exp(s - m), values
    acc = sum exp(s - m) v), m and l [B, Hkv, G, T], acc [B, Hkv, G, T, D], f32. Partials
    over disjoint slot sets combine with `merge_partials`; a row with nothing unmasked has
    m = -inf, l = 0, acc = 0."""
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    block = max(1, min(block, s))
    n = -(-s // block)
    pad = n * block - s
    by_block = lambda x: jnp.moveaxis(jnp.pad(  # noqa: E731  [B, S, ...] -> [n, B, blk, ...]
        x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)).reshape(
            (b, n, block) + x.shape[2:]), 1, 0)
    qg = q.reshape(b, t, hkv, hq // hkv, d).astype(jnp.float32) / jnp.sqrt(d)
    masks = jnp.moveaxis(jnp.pad(mask, ((0, 0), (0, 0), (0, pad))).reshape(b, t, n, block),
                         2, 0)

    def step(carry, xs):
        m_prev, l_prev, acc = carry
        kb, vb, mb = xs
        sc = jnp.einsum("btkgd,bskd->bkgts", qg, kb.astype(jnp.float32))
        sc = jnp.where(mb[:, None, None], sc, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(sc, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_next), m_next, 0.0)
        corr = jnp.exp(jnp.where(jnp.isfinite(m_prev), m_prev - m_safe, -jnp.inf))
        p = jnp.exp(sc - m_safe[..., None])  # masked: exp(-inf) = 0
        acc = corr[..., None] * acc + jnp.einsum("bkgts,bskd->bkgtd", p,
                                                 vb.astype(jnp.float32))
        return (m_next, corr * l_prev + jnp.sum(p, axis=-1), acc), None

    g = hq // hkv
    init = (jnp.full((b, hkv, g, t), -jnp.inf), jnp.zeros((b, hkv, g, t)),
            jnp.zeros((b, hkv, g, t, d)))
    (m, l, acc), _ = jax.lax.scan(step, init, (by_block(k), by_block(v), masks))
    return m, l, acc


def merge_partials(parts, dtype) -> Float[Array, "B T Hq D"]:
    """One softmax's output [B, T, Hq, D] from `attention_partial`s over disjoint slot
    sets; a row with nothing unmasked anywhere gets zeros (as `masked_softmax_weights`)."""
    m = functools.reduce(jnp.maximum, [p[0] for p in parts])
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    scale = [jnp.exp(jnp.where(jnp.isfinite(mi), mi - m_safe, -jnp.inf)) for mi, _, _ in parts]
    total = sum(c * li for c, (_, li, _) in zip(scale, parts))
    acc = sum(c[..., None] * ai for c, (_, _, ai) in zip(scale, parts))
    out = acc / jnp.maximum(total, jnp.finfo(total.dtype).tiny)[..., None]  # [B,K,G,T,D]
    b, hkv, g, t, d = out.shape
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hkv * g, d).astype(dtype)
