"""How far a model's next-token distribution moves from a reference's on the same text.

A KV codec is judged against the model with an exact-enough cache (bf16 KV) at the
context lengths it serves: per scored position, KL(reference || model) of the next-token
distributions and whether both put their top-1 on the same token, plus both models'
continuation perplexity. Each window's first `n_context` tokens are prefilled through the
model's own caches in pieces (`research.eval.perplexity.scored_pieces`, the loop
perplexity uses) and its last L - n_context tokens are scored.

The reference runs once per batch of windows, however many models are compared to it
(`divergences`): its logits over the batch's continuation stay on the device
([batch, L - n_context, V] floats) while each model's pass is compared to them, so the
reference's long prefill is not repeated per codec.
"""
from __future__ import annotations

import math
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from research.eval.perplexity import scored_pieces
from research.model.llama import Model


class Divergence(NamedTuple):
    kl: float  # mean per-token KL(reference || model), nats
    top1: float  # fraction of scored positions where both models' argmax agree
    ppl: float  # the model's continuation perplexity
    ref_ppl: float  # the reference's, on the same tokens
    n_tokens: int  # scored positions in all
    window_kl: tuple[float, ...]  # per window: mean KL over its scored positions
    window_top1: tuple[float, ...]
    window_nll: tuple[float, ...]  # mean NLL (nats/token) of the model
    window_ref_nll: tuple[float, ...]


def _logits(logits, start):
    return logits.astype(jnp.float32)


def continuation_logits(model: Model, windows, n_context: int, *, chunk: int = 512):
    """[n, L - n_context, V] float32 logits of `model` at positions n_context - 1 .. L - 2
    of each window (row j predicts token n_context + j), the windows [n, L] prefilled
    through `model.caches` in pieces of `chunk` tokens."""
    wins = _check_windows(windows, n_context)
    n, length = wins.shape
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    first, stop = n_context - 1, length - 1  # the positions whose predictions are scored
    states = model.init_cache(n, length)
    parts = []
    for c0, logits in scored_pieces(model, wins, np.full((n,), length, np.int32), states,
                                    chunk, _logits, prefill_until=first):
        lo, hi = max(c0, first), min(c0 + chunk, stop)
        if lo < hi:
            parts.append(logits[:, lo - c0:hi - c0])
    return jnp.concatenate(parts, axis=1)


# |logit differences| below this take the cancellation-free KL form (expm1 / log1p)
_SMALL_SHIFT = 30.0


@jax.jit
def logit_sums(ref_logits, logits, targets):
    """Per row: sums over positions of KL(ref || model), top-1 agreement, model NLL and
    reference NLL. ref_logits, logits: [b, k, V]; targets: [b, k].

    KL = E_p[d] + log E_p[exp(-d)] with d = ref_logits - logits (p: the reference's
    distribution), so the normalizers never enter: KL(log_softmax - log_softmax) in
    float32 loses ~1e-6 nats to rounding the log-probabilities (0.3% of the 1.5e-5 KL of
    the tests' int8 cache); log E_p[exp(-d)] is log1p(E_p[expm1(-d)]) while d is small."""
    ref_logp = jax.nn.log_softmax(ref_logits, axis=-1)
    logp = jax.nn.log_softmax(logits, axis=-1)
    p = jnp.exp(ref_logp)
    d = ref_logits - logits
    mean_d = jnp.sum(p * d, -1)
    small = jnp.max(jnp.abs(d), -1) < _SMALL_SHIFT
    d_small = jnp.where(small[..., None], d, 0.0)  # no overflow in the branch not taken
    log_mgf = jnp.where(small, jnp.log1p(jnp.sum(p * jnp.expm1(-d_small), -1)),
                        jax.nn.logsumexp(ref_logp - d, axis=-1))
    kl = jnp.maximum(mean_d + log_mgf, 0.0)
    agree = jnp.argmax(ref_logits, -1) == jnp.argmax(logits, -1)
    pick = lambda lp: -jnp.take_along_axis(lp, targets[..., None], -1)[..., 0]  # noqa: E731
    return (jnp.sum(kl, 1), jnp.sum(agree, 1), jnp.sum(pick(logp), 1),
            jnp.sum(pick(ref_logp), 1))


def divergences(reference: Model, models: Mapping[str, Model], windows, n_context: int, *,
                batch_size: int = 2, chunk: int = 512) -> dict[str, Divergence]:
    """`Divergence` of each of `models` from `reference` over the continuation (tokens
    n_context..L-1) of every window [n, L] (module docstring)."""
    wins = _check_windows(windows, n_context)
    if not models:
        raise ValueError("models is empty: pass at least one model to compare")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    sums = {name: [] for name in models}  # per batch: [4, b] sums (kl, agree, nll, ref_nll)
    for i in range(0, len(wins), batch_size):
        batch = wins[i:i + batch_size]
        targets = jnp.asarray(batch[:, n_context:])
        ref = continuation_logits(reference, batch, n_context, chunk=chunk)
        for name, model in models.items():
            logits = continuation_logits(model, batch, n_context, chunk=chunk)
            sums[name].append(np.stack([np.asarray(x, np.float64)
                                        for x in logit_sums(ref, logits, targets)]))
            del logits
        del ref
    per_token = wins.shape[1] - n_context
    return {name: summarize(np.concatenate(s, axis=1), per_token)
            for name, s in sums.items()}


def divergence(reference: Model, model: Model, windows, n_context: int, *,
               batch_size: int = 2, chunk: int = 512) -> Divergence:
    """`divergences` of one model."""
    return divergences(reference, {"model": model}, windows, n_context,
                       batch_size=batch_size, chunk=chunk)["model"]


def summarize(sums: np.ndarray, per_window: int) -> Divergence:
    """Divergence from per-window sums [4, n] over `per_window` positions each."""
    kl, agree, nll, ref_nll = sums
    n_tokens = per_window * sums.shape[1]
    mean = lambda x: float(np.sum(x) / n_tokens)  # noqa: E731
    if not all(math.isfinite(mean(x)) for x in sums):
        raise FloatingPointError(f"divergence is not finite (KL {mean(kl)}, NLL "
                                 f"{mean(nll)}, reference NLL {mean(ref_nll)})")
    window = lambda x: tuple(float(v) for v in x / per_window)  # noqa: E731
    return Divergence(mean(kl), mean(agree), math.exp(mean(nll)), math.exp(mean(ref_nll)),
                      n_tokens, window(kl), window(agree), window(nll), window(ref_nll))


def _check_windows(windows, n_context: int) -> np.ndarray:
    wins = np.asarray(windows)
    if wins.ndim != 2 or not np.issubdtype(wins.dtype, np.integer):
        raise ValueError(f"windows must be [n, L] integer token ids, got shape {wins.shape} "
                         f"of {wins.dtype}")
    if len(wins) == 0:
        raise ValueError("windows is empty: pass at least one window")
    if not 0 < n_context < wins.shape[1]:
        raise ValueError(f"n_context must be in [1, L={wins.shape[1]}), got {n_context}")
    return wins.astype(np.int32)
