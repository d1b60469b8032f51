"""specscale's statistics against scipy.stats and against their textbook definitions, on
fresh random inputs: Wilson interval = binomtest(...).proportion_ci(method="wilson"),
step AUROC = Mann-Whitney U / (n_pos n_neg), paired bootstrap = scipy.stats.bootstrap
(paired=True, method="percentile", same generator: the same resamples, so the same
interval). The definitions below stay the oracle whichever implementation metrics.py uses.
"""
import math

import numpy as np
import pytest
from scipy import stats

from research.specscale.metrics import paired_bootstrap_diff, wilson_interval
from research.specscale.verifier import step_auroc


def _wilson_formula(k, n, z):
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def _auroc_pairs(scores, correct):
    s, c = np.asarray(scores, float), np.asarray(correct, bool)
    pos, neg = s[c], s[~c]
    return float((pos[:, None] > neg).mean() + 0.5 * (pos[:, None] == neg).mean())


@pytest.mark.parametrize("seed", range(3))
def test_wilson_matches_scipy_binomtest(seed):
    rng = np.random.default_rng([seed, 1])
    for _ in range(300):
        n = int(rng.integers(1, 500))
        k = int(rng.choice([0, n, rng.integers(0, n + 1)]))
        z = float(rng.choice([1.0, 1.645, 1.96, 2.576]))
        ci = stats.binomtest(k, n).proportion_ci(confidence_level=2 * stats.norm.cdf(z) - 1,
                                                 method="wilson")
        got = wilson_interval(k, n, z)
        np.testing.assert_allclose(got, (ci.low, ci.high), rtol=0, atol=1e-12)
        np.testing.assert_allclose(got, _wilson_formula(k, n, z), rtol=0, atol=1e-12)
    # the default z=1.96 is scipy's 95% up to z's rounding (norm.ppf(0.975) = 1.95996...)
    ci = stats.binomtest(12, 24).proportion_ci(method="wilson")
    np.testing.assert_allclose(wilson_interval(12, 24), (ci.low, ci.high), atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_step_auroc_matches_mann_whitney_u(seed):
    rng = np.random.default_rng([seed, 2])
    for _ in range(100):
        n = int(rng.integers(2, 300))
        # few distinct values, so ties (counted half) are common
        scores = rng.integers(0, int(rng.integers(2, 30)), n).astype(float)
        correct = rng.random(n) < rng.uniform(0.05, 0.95)
        correct[:2] = [True, False]
        pos, neg = scores[correct], scores[~correct]
        u = stats.mannwhitneyu(pos, neg).statistic / (pos.size * neg.size)
        assert step_auroc(scores, correct) == pytest.approx(u, abs=1e-12)
        assert step_auroc(scores, correct) == pytest.approx(_auroc_pairs(scores, correct),
                                                            abs=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_paired_bootstrap_matches_scipy_bootstrap(seed):
    rng = np.random.default_rng([seed, 3])
    for _ in range(30):
        n, n_boot = int(rng.integers(2, 300)), int(rng.choice([200, 2000, 10_000]))
        a, b = rng.random(n) < rng.random(), rng.random(n) < rng.random()
        boot_seed = int(rng.integers(0, 2**31))
        d, lo, hi = paired_bootstrap_diff(a, b, n_boot=n_boot, seed=boot_seed)
        res = stats.bootstrap((a.astype(float), b.astype(float)),
                              lambda x, y, axis: np.mean(x - y, axis=axis), paired=True,
                              vectorized=True, n_resamples=n_boot, method="percentile",
                              rng=np.random.default_rng(boot_seed))
        assert d == pytest.approx(a.mean() - b.mean(), abs=1e-12)
        np.testing.assert_allclose((lo, hi), (res.confidence_interval.low,
                                              res.confidence_interval.high), rtol=0, atol=1e-12)
        # the definition: resample problems with replacement, percentile interval
        idx = np.random.default_rng(boot_seed).integers(0, n, (n_boot, n))
        ref = np.percentile((a[idx].astype(float) - b[idx]).mean(1), [2.5, 97.5])
        np.testing.assert_allclose((lo, hi), ref, rtol=0, atol=1e-12)
