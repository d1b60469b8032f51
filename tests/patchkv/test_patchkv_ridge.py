"""Closed-form ridge: equals a least-squares solver, selection, and bad input."""
import math

import numpy as np
import pytest

from research.patchkv import ridge


def _data(n=120, d=16, q=5, seed=0, noise=0.1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    w = rng.normal(size=(d, q))
    return x, x @ w + noise * rng.normal(size=(n, q)), w


@pytest.mark.parametrize("lam", [0.0, 1e-3, 0.7, 50.0])
def test_closed_form_equals_lstsq_on_augmented_system(lam):
    x, y, _ = _data(seed=1)
    d = x.shape[1]
    aug_x = np.vstack([x, math.sqrt(lam) * np.eye(d)])
    aug_y = np.vstack([y, np.zeros((d, y.shape[1]))])
    expect = np.linalg.lstsq(aug_x, aug_y, rcond=None)[0]
    np.testing.assert_allclose(ridge.ridge_solve(x, y, lam), expect, rtol=1e-9, atol=1e-10)


def test_singular_and_tiny_probe_sets_give_min_norm_solution():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(5, 12))  # fewer rows than features: singular Gram
    x[:, 3] = x[:, 4]  # and a duplicated column
    y = rng.normal(size=(5, 3))
    got = ridge.ridge_solve(x, y, 0.0)
    np.testing.assert_allclose(got, np.linalg.pinv(x) @ y, rtol=1e-7, atol=1e-9)
    assert np.all(np.isfinite(got))
    one = ridge.ridge_solve(x[:1], y[:1], 1e-3)  # a single probe token
    assert np.all(np.isfinite(one))


def test_residual_and_gcv_match_direct_formulas():
    x, y, _ = _data(n=60, d=10, seed=3)
    e = ridge.gram_eig(x, y)
    lam = 0.5
    delta = ridge.solve(e, lam)
    rss = float(np.sum((y - x @ delta) ** 2))
    np.testing.assert_allclose(ridge.residual_sq(e, lam), rss, rtol=1e-8)
    hat = x @ np.linalg.solve(x.T @ x + lam * np.eye(10), x.T)
    gcv = rss / 60 / (1 - np.trace(hat) / 60) ** 2
    np.testing.assert_allclose(ridge.gcv_score(e, lam), gcv, rtol=1e-8)


def test_zero_targets_give_zero_patch_and_huge_penalty_gives_none():
    x, y, _ = _data(seed=4)
    for sel in ("holdout", "gcv", "fixed"):
        holdout = np.arange(x.shape[0]) % 4 == 0
        fit = ridge.fit_ridge(x, np.zeros_like(y), holdout, ridge.RidgeConfig(selection=sel))
        assert np.all(fit.delta == 0)
    big = ridge.fit_ridge(x, y, None, ridge.RidgeConfig(selection="fixed", alpha=1e12))
    assert np.max(np.abs(big.delta)) < 1e-9 * np.max(np.abs(ridge.ridge_solve(x, y, 0.0)))


def test_selection_recovers_signal_and_refuses_pure_noise():
    x, y, w = _data(n=400, d=8, seed=5, noise=0.05)
    holdout = np.arange(400) % 4 == 0
    for sel in ("holdout", "gcv"):
        fit = ridge.fit_ridge(x, y, holdout, ridge.RidgeConfig(selection=sel))
        assert math.isfinite(fit.alpha) and fit.alpha <= 1e-2
        np.testing.assert_allclose(fit.delta, w, atol=0.02)
        assert fit.train_rel_err[1] < 0.1 * fit.train_rel_err[0]
    rng = np.random.default_rng(6)
    noise_x, noise_y = rng.normal(size=(40, 30)), rng.normal(size=(40, 4))
    fit = ridge.fit_ridge(noise_x, noise_y, np.arange(40) % 2 == 0, ridge.RidgeConfig())
    assert fit.val_rel_err[1] <= fit.val_rel_err[0]  # never worse than no patch on held-out
    # Held-out rows that contradict the fit rows: only the zero patch does no harm.
    y_flip = np.where(holdout[:, None], -y, y)
    fit = ridge.fit_ridge(x, y_flip, holdout, ridge.RidgeConfig())
    assert math.isinf(fit.alpha) and np.all(fit.delta == 0)


def test_bad_input():
    x, y, _ = _data(n=10, d=3)
    with pytest.raises(ValueError, match="no rows"):
        ridge.fit_ridge(x[:0], y[:0])
    with pytest.raises(ValueError, match="rows"):
        ridge.fit_ridge(x, y[:5])
    with pytest.raises(ValueError, match="2-D"):
        ridge.fit_ridge(x[:, 0], y)
    bad = x.copy()
    bad[0, 0] = np.nan
    with pytest.raises(FloatingPointError, match="NaN"):
        ridge.fit_ridge(bad, y)
    with pytest.raises(ValueError, match="held out"):
        ridge.fit_ridge(x, y, np.zeros(10, bool), ridge.RidgeConfig(selection="holdout"))
    with pytest.raises(ValueError, match="holdout must be"):
        ridge.fit_ridge(x, y, np.zeros(3, bool))
    with pytest.raises(ValueError, match="selection"):
        ridge.RidgeConfig(selection="cv")
    with pytest.raises(ValueError, match="alphas"):
        ridge.RidgeConfig(alphas=(-1.0,))
    with pytest.raises(ValueError, match="lam"):
        ridge.solve(ridge.gram_eig(x, y), -1.0)


def test_held_out_error_matches_direct_computation():
    x, y, _ = _data(n=300, d=12, q=4, seed=8, noise=1.0)
    holdout = np.arange(300) % 3 == 0
    fit = ridge.fit_ridge(x, y, holdout, ridge.RidgeConfig(allow_zero=False))
    e = ridge.gram_eig(x[~holdout], y[~holdout])
    direct = ridge.solve(e, fit.alpha * e.scale)
    rel = np.linalg.norm(y[holdout] - x[holdout] @ direct) / np.linalg.norm(y[holdout])
    np.testing.assert_allclose(fit.val_rel_err[1], rel, rtol=1e-8)


def _reduced_rank_direct(x, y, lam, rank):
    """Reduced-rank ridge straight from its definition: project the ridge solution onto
    the top right singular vectors of the augmented fitted values [X; sqrt(lam) I] D."""
    d = x.shape[1]
    full = np.linalg.solve(x.T @ x + lam * np.eye(d), x.T @ y)
    fitted = np.vstack([x, math.sqrt(lam) * np.eye(d)]) @ full
    w = np.linalg.svd(fitted, full_matrices=False)[2][:rank].T
    return full @ w @ w.T


def _low_rank_data(n, d, q, rank, seed, noise):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    w = rng.normal(size=(d, rank)) @ rng.normal(size=(rank, q))
    return x, x @ w + noise * rng.normal(size=(n, q))


def test_reduced_rank_matches_definition_and_its_held_out_error():
    x, y = _low_rank_data(n=200, d=14, q=10, rank=3, seed=11, noise=2.0)
    holdout = np.arange(200) % 4 == 0
    config = ridge.RidgeConfig(ranks=(1, 2, 3, 5, 8), allow_zero=False)
    fit = ridge.fit_ridge(x, y, holdout, config)
    assert fit.rank is not None and fit.rank in config.ranks
    assert np.linalg.matrix_rank(fit.delta, tol=1e-8) == fit.rank
    np.testing.assert_allclose(fit.delta, _reduced_rank_direct(x, y, fit.lam, fit.rank),
                               rtol=1e-7, atol=1e-9)
    # the two factors a server stores: [d, r] and [r, q], their product the delta
    left, right = fit.factors
    assert left.shape == (14, fit.rank) and right.shape == (fit.rank, 10)
    np.testing.assert_allclose(left @ right, fit.delta, rtol=1e-10, atol=1e-12)
    assert ridge.fit_ridge(x, y, holdout, ridge.RidgeConfig(allow_zero=False)).factors is None
    # the held-out error the selection reports is the error of that (alpha, rank) fitted
    # on the fit rows alone
    e = ridge.gram_eig(x[~holdout], y[~holdout])
    on_fit_rows = _reduced_rank_direct(x[~holdout], y[~holdout], fit.alpha * e.scale,
                                       fit.rank)
    rel = np.linalg.norm(y[holdout] - x[holdout] @ on_fit_rows) / np.linalg.norm(y[holdout])
    np.testing.assert_allclose(fit.val_rel_err[1], rel, rtol=1e-7)
    # and it is no worse than the best full-rank alpha (full rank stays a candidate)
    full = ridge.fit_ridge(x, y, holdout, ridge.RidgeConfig(allow_zero=False))
    assert fit.val_rel_err[1] <= full.val_rel_err[1] + 1e-12


def test_reduced_rank_recovers_a_low_rank_map_from_few_noisy_rows():
    x, y = _low_rank_data(n=60, d=20, q=20, rank=2, seed=12, noise=3.0)
    holdout = np.arange(60) % 3 == 0
    fit = ridge.fit_ridge(x, y, holdout, ridge.RidgeConfig(ranks=(1, 2, 4, 8, 16)))
    assert fit.rank is not None and fit.rank <= 4


def test_reduced_rank_needs_holdout_and_positive_ranks():
    with pytest.raises(ValueError, match="ranks"):
        ridge.RidgeConfig(ranks=(0,))
    with pytest.raises(ValueError, match="holdout"):
        ridge.RidgeConfig(selection="gcv", ranks=(4,))
    with pytest.raises(ValueError, match="ranks"):
        ridge.RidgeConfig(allow_full_rank=False)


def test_a_rank_cap_above_the_dimensions_is_no_cap():
    x, y, _ = _data(n=120, d=8, q=6, seed=13)
    holdout = np.arange(120) % 4 == 0
    capped = ridge.fit_ridge(x, y, holdout, ridge.RidgeConfig(ranks=(64,),
                                                              allow_full_rank=False))
    free = ridge.fit_ridge(x, y, holdout, ridge.RidgeConfig())
    np.testing.assert_allclose(capped.delta, free.delta)
    assert capped.rank is None
