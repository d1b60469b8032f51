"""Quality of a prefill/decode weight-set pair on held-out text, against f32.

The handoff protocol: each window of T tokens is prefilled (its first `n_prefill` tokens)
by the prefill model, which writes the KV cache; the decode model then continues from that
cache over the remaining tokens, teacher-forced (one chunk through the cache: the same
causal attention over the same cache as decoding them one at a time, see the tests). The
scored positions are the decoded ones: NLL of the next token and the per-token KL(f32 ||
model) of the next-token distribution, against the f32 model run the same way. The prefill
half is scored too (its logits come from the prefill set).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from research.model.llama import Model, forward


def _handoff(prefill_model: Model, decode_model: Model, tokens: jax.Array, n_prefill: int):
    """(prefill logits [B, P, V], decode logits [B, T-P, V]) of tokens [B, T]: the first
    P = n_prefill tokens prefilled by `prefill_model`, the rest run by `decode_model` over
    the cache it wrote (jitted as `handoff_logits`, n_prefill static)."""
    b, t = tokens.shape
    states = prefill_model.init_cache(b, t)
    pre = forward(prefill_model, tokens[:, :n_prefill], cache_states=states)
    dec = forward(decode_model, tokens[:, n_prefill:], cache_states=pre.cache_states,
                  start=jnp.full((b,), n_prefill, jnp.int32))
    return pre.logits, dec.logits


handoff_logits = jax.jit(_handoff, static_argnums=(3,))


@jax.jit
def _scores(logits, ref_logits, targets):
    """Per position NLL of targets and KL(ref || logits), [B, T]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    ref = jax.nn.log_softmax(ref_logits.astype(jnp.float32), -1)
    nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    kl = jnp.sum(jnp.exp(ref) * (ref - logp), -1)
    return nll, kl


class Scores(NamedTuple):
    nll_prefill: float  # mean next-token NLL over the prefilled positions
    nll_decode: float  # ... over the decoded positions
    kl_prefill: float  # mean per-token KL(f32 || model) over the prefilled positions
    kl_decode: float
    n_prefill_tokens: int
    n_decode_tokens: int

    @property
    def ppl_decode(self) -> float:
        return math.exp(self.nll_decode)

    @property
    def ppl_all(self) -> float:
        n = self.n_prefill_tokens + self.n_decode_tokens
        return math.exp((self.nll_prefill * self.n_prefill_tokens
                         + self.nll_decode * self.n_decode_tokens) / n)


def windows(ids, window: int, n_windows: int, offset: int = 0) -> np.ndarray:
    """`n_windows` consecutive, non-overlapping windows of `window` tokens of `ids`,
    starting at window index `offset`. The experiment takes dev and test windows from the
    protocol's two halves of the held-out text (offset 0 in each), never from one text by
    offset (docs/protocol.md)."""
    ids = np.asarray(ids, np.int32)
    need = (offset + n_windows) * window
    if need > len(ids):
        raise ValueError(f"text has {len(ids)} tokens, need {need} for windows "
                         f"[{offset}, {offset + n_windows}) of {window}")
    return ids[offset * window:need].reshape(n_windows, window)


def evaluate_pairs(pairs: dict, reference: tuple[Model, Model], tokens: np.ndarray,
                   n_prefill: int, batch_size: int) -> dict[str, Scores]:
    """Scores of every (prefill_model, decode_model) in `pairs` (name -> pair) on `tokens`
    [N, T] windows, KL against `reference` (the f32 pair) run the same way. Batches are
    the outer loop so one batch of reference logits is held at a time."""
    if not 1 <= n_prefill < tokens.shape[1] - 1:
        raise ValueError(f"n_prefill must be in [1, T-1) for T={tokens.shape[1]}, got "
                         f"{n_prefill}")
    sums = {name: np.zeros(4) for name in pairs}
    counts = np.zeros(2, np.int64)
    for i in range(0, len(tokens), batch_size):
        batch = jnp.asarray(tokens[i:i + batch_size])
        ref_pre, ref_dec = handoff_logits(*reference, batch, n_prefill)
        # prefill positions 0..P-1 predict tokens 1..P; decode positions P..T-2 predict
        # P+1..T-1 (the last decode position has no target)
        tgt_pre, tgt_dec = batch[:, 1:n_prefill + 1], batch[:, n_prefill + 1:]
        counts += [tgt_pre.size, tgt_dec.size]
        for name, (pm, dm) in pairs.items():
            pre, dec = handoff_logits(pm, dm, batch, n_prefill)
            nll_p, kl_p = _scores(pre, ref_pre, tgt_pre)
            nll_d, kl_d = _scores(dec[:, :-1], ref_dec[:, :-1], tgt_dec)
            sums[name] += [float(nll_p.sum()), float(nll_d.sum()), float(kl_p.sum()),
                           float(kl_d.sum())]
    return {name: Scores(s[0] / counts[0], s[1] / counts[1], s[2] / counts[0],
                         s[3] / counts[1], int(counts[0]), int(counts[1]))
            for name, s in sums.items()}
