"""Checking the exactness claim: the exact law of the first tokens vs sampled outputs.

`exact_sequence_law` enumerates every continuation of a prompt with non-zero probability
under the filtered sampling distribution (`token_probs`: temperature / top-k / top-p), so
keep the support small (a small vocabulary, or top-k). `chisquare_pvalue` compares
observed counts with it (Pearson, small cells pooled).
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

import jax.numpy as jnp
import numpy as np
from scipy import stats

from research.model.llama import Model, forward
from research.decode.sampling import SamplingConfig, token_probs


def exact_sequence_law(model: Model, prompt: Sequence[int], sampling: SamplingConfig,
                       n_tokens: int, max_support: int = 100_000) -> dict[tuple, float]:
    """P(t_1..t_n | prompt) for every continuation with non-zero probability."""
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    law = {(): 1.0}
    for _ in range(n_tokens):
        prefixes = list(law)
        seqs = np.asarray([list(prompt) + list(p) for p in prefixes], np.int32)
        logits = forward(model, jnp.asarray(seqs), logits="last").logits
        probs = np.asarray(token_probs(logits, sampling), np.float64)
        new = {}
        for prefix, row in zip(prefixes, probs):
            for tok in np.flatnonzero(row > 0):
                new[prefix + (int(tok),)] = law[prefix] * float(row[tok])
        if len(new) > max_support:
            raise ValueError(f"the support has {len(new)} sequences > max_support="
                             f"{max_support}: use a smaller vocabulary, top_k or n_tokens")
        law = new
    return law


def chisquare_pvalue(samples: Iterable[tuple], law: dict[tuple, float],
                     min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of sampled sequences against an exact law.

    Cells expected below `min_expected` are pooled (the test's asymptotics need it); a
    sample outside the law's support gives 0.
    """
    counts = Counter(tuple(s) for s in samples)
    n = sum(counts.values())
    if n == 0:
        raise ValueError("samples is empty")
    if any(s not in law for s in counts):
        return 0.0
    keys = list(law)
    probs = np.asarray([law[k] for k in keys], np.float64)
    obs = np.asarray([counts.get(k, 0) for k in keys], np.float64)
    exp = probs / probs.sum() * n
    small = exp < min_expected
    obs = np.append(obs[~small], obs[small].sum())
    exp = np.append(exp[~small], exp[small].sum())
    keep = exp > 0
    if keep.sum() < 2:
        return 1.0  # one possible outcome: nothing to test
    return float(stats.chisquare(obs[keep], exp[keep]).pvalue)
