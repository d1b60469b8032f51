"""Honest uncertainty for small evaluation sets: Wilson intervals and paired bootstrap,
both from scipy.stats (tests/specscale/test_stats_scipy.py checks them against their
definitions)."""
from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy import stats


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion at the confidence of the normal
    quantile `z` (95% by default): scipy's binomtest(...).proportion_ci(method="wilson")."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes}")
    ci = stats.binomtest(int(successes), int(n)).proportion_ci(
        confidence_level=2 * stats.norm.cdf(z) - 1, method="wilson")
    return float(ci.low), float(ci.high)


def paired_bootstrap_diff(a: Sequence[bool], b: Sequence[bool], *, n_boot: int = 10_000,
                          seed: int = 0) -> tuple[float, float, float]:
    """mean(a) - mean(b) on the same problems, with a 95% paired-bootstrap interval
    (scipy.stats.bootstrap, paired, percentile method: problems resampled with
    replacement)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"a and b must be equal-length non-empty 1-D, got {a.shape}, {b.shape}")
    diff = float(a.mean() - b.mean())
    if a.size == 1:  # every resample is the one problem (scipy asks for two)
        return diff, diff, diff
    res = stats.bootstrap((a, b), lambda x, y, axis: np.mean(x - y, axis=axis), paired=True,
                          vectorized=True, n_resamples=n_boot, method="percentile",
                          rng=np.random.default_rng(seed))
    return diff, float(res.confidence_interval.low), float(res.confidence_interval.high)
