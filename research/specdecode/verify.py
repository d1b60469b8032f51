"""Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

Given the target's distributions p_0..p_K at the pending token and the K drafted tokens,
and the draft distributions q_1..q_K they were sampled from:

  accept drafted token d_i with probability min(1, p_{i-1}(d_i) / q_i(d_i)), in order;
  at the first rejection i, emit a token from norm(max(0, p_{i-1} - q_i)) and stop;
  if all n drafted tokens are accepted, emit a bonus token from p_n.

Each emitted token is then distributed exactly as the target would sample it, whatever
the draft. A deterministic drafter has q one-hot on its token: accept with probability
p(d), resample from p with d removed. In greedy mode p is one-hot on the argmax, so a
drafted token is accepted iff it is the target's argmax and the emitted token is the
argmax where the draft diverged: token for token plain greedy decoding.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


class Verdict(NamedTuple):
    n_accepted: Int[Array, "B"]  # drafted tokens accepted, in [0, n_drafted]
    next_token: Int[Array, "B"]  # correction (first rejection) or bonus token


def residual_distribution(p: Float[Array, "B V"], q: Float[Array, "B V"]) -> Array:
    """norm(max(0, p - q)); falls back to p where the residual has no mass.

    In exact arithmetic a rejection (probability sum(max(0, q - p))) cannot happen when
    the residual is empty, so the fallback only absorbs float round-off.
    """
    r = jnp.maximum(p - q, 0.0)
    mass = jnp.sum(r, axis=-1, keepdims=True)
    return jnp.where(mass > 0, r / jnp.where(mass > 0, mass, 1.0), p)


def verify_drafts(target_probs: Float[Array, "B K1 V"], draft_tokens: Int[Array, "B K"],
                  draft_probs: Float[Array, "B K V"] | None, n_drafted: Int[Array, "B"],
                  key: jax.Array, *, greedy: bool) -> Verdict:
    """Accept a prefix of each row's draft and pick the next token (see module doc).

    target_probs[b, i]: the target's (filtered) next-token distribution after the pending
      token and drafted tokens 1..i (i = 0..K); draft_tokens[b, i] is drafted token i+1.
    draft_probs: the distribution each drafted token was sampled from, None if one-hot.
    n_drafted: real drafted tokens per row (the rest is padding and never accepted).
    greedy: target_probs are one-hot argmaxes; decisions need no randomness.
    """
    b, k1, v = target_probs.shape
    k = k1 - 1
    if draft_tokens.shape != (b, k):
        raise ValueError(f"draft_tokens must be [B, K] = {(b, k)}, got {draft_tokens.shape}")
    if draft_probs is not None and draft_probs.shape != (b, k, v):
        raise ValueError(f"draft_probs must be [B, K, V] = {(b, k, v)}, "
                         f"got {draft_probs.shape}")
    key_accept, key_resample = jax.random.split(key)
    if k:
        p_draft = jnp.take_along_axis(target_probs[:, :k], draft_tokens[..., None], -1)[..., 0]
        q_draft = (jnp.ones_like(p_draft) if draft_probs is None else
                   jnp.take_along_axis(draft_probs, draft_tokens[..., None], -1)[..., 0])
        if greedy:
            ok = p_draft > 0.5  # one-hot p: the drafted token is the argmax
        else:
            u = jax.random.uniform(key_accept, (b, k))
            ok = u * q_draft < p_draft  # u < p / q without dividing by q
        ok &= jnp.arange(k)[None, :] < n_drafted[:, None]
        n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    else:
        n_acc = jnp.zeros((b,), jnp.int32)
    rows = jnp.arange(b)
    p_next = target_probs[rows, n_acc]  # [B, V]
    rejected = n_acc < n_drafted
    if k:
        pos = jnp.minimum(n_acc, k - 1)
        q_rej = (jax.nn.one_hot(draft_tokens[rows, pos], v, dtype=p_next.dtype)
                 if draft_probs is None else draft_probs[rows, pos])
        p_next = jnp.where(rejected[:, None], residual_distribution(p_next, q_rej), p_next)
    if greedy:
        nxt = jnp.argmax(p_next, axis=-1)
    else:
        logp = jnp.where(p_next > 0, jnp.log(jnp.where(p_next > 0, p_next, 1.0)), -jnp.inf)
        nxt = jax.random.categorical(key_resample, logp, axis=-1)
    return Verdict(n_acc.astype(jnp.int32), nxt.astype(jnp.int32))
