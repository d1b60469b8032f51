"""Closed-form multi-output ridge regression with the penalty chosen on data.

    delta = argmin_D ||X D - Y||^2 + lam ||D||^2 = (X^T X + lam I)^-1 X^T Y

solved in float64 through one eigendecomposition of the Gram matrix G = X^T X, so a whole
grid of lam costs one decomposition. lam is expressed relative to the data scale,
lam = alpha * trace(G) / d (alpha times the mean eigenvalue), so one alpha grid fits every
layer. Selection:

* "holdout" (default): alpha minimising the squared error on held-out rows (whole probe
  sequences, so neighbouring, correlated tokens never straddle the split), then a refit
  on all rows with that alpha;
* "gcv": generalised cross-validation, closed form from the eigenvalues;
* "fixed": the given alpha.

Reduced rank (`ranks`, holdout only): the ridge solution D is projected onto the top-r
right singular vectors W_r of its augmented fitted values [X; sqrt(lam) I] D (reduced-rank
ridge, Mukherjee & Zhu 2011): D_r = D W_r W_r^T. (alpha, r) are chosen jointly on the
held-out rows; a rank-r patch is stored as two factors, r (d_in + d_out) numbers instead of
d_in d_out, and the constraint is one more regulariser.

"Do no harm": the zero patch (alpha = inf) is always a candidate, so a layer whose patch
does not beat zero on held-out rows (or on GCV) stays unpatched.

lam = 0 on a singular Gram matrix gives the minimum-norm least-squares solution
(eigenvalues below `rtol * max` are treated as zero), never inf/NaN.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np
import scipy.linalg

from threadpoolctl import threadpool_limits

SELECTIONS = ("holdout", "gcv", "fixed")


@dataclasses.dataclass(frozen=True)
class RidgeConfig:
    selection: str = "holdout"
    alphas: tuple[float, ...] = (1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0, 10.0)
    alpha: float = 1e-2  # used by selection="fixed"
    allow_zero: bool = True  # the zero patch competes with every alpha
    ranks: tuple[int, ...] = ()  # reduced ranks that compete with full rank (holdout only)
    allow_full_rank: bool = True  # False: only `ranks` (caps the stored patch's bytes)

    def __post_init__(self):
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        if not self.alphas or any(not (a >= 0 and math.isfinite(a)) for a in self.alphas):
            raise ValueError(f"alphas must be a non-empty tuple of finite values >= 0, "
                             f"got {self.alphas}")
        if not (self.alpha >= 0):
            raise ValueError(f"alpha must be >= 0, got {self.alpha}")
        if any(not (isinstance(r, int) and r >= 1) for r in self.ranks):
            raise ValueError(f"ranks must be positive ints, got {self.ranks}")
        if not self.allow_full_rank and not self.ranks:
            raise ValueError("allow_full_rank=False needs some ranks to choose from")
        if self.ranks and self.selection != "holdout":
            raise ValueError(f"ranks need selection='holdout' (the rank is chosen on held-out "
                             f"rows), got selection={self.selection!r}")


class RidgeFit(NamedTuple):
    delta: np.ndarray  # [d_in, d_out] float64 (all zero when the zero patch won)
    alpha: float  # chosen alpha (inf = zero patch)
    lam: float  # absolute penalty used for `delta`
    train_rel_err: tuple[float, float]  # ||Y - X D|| / ||Y|| before (D=0) / after, all rows
    val_rel_err: tuple[float, float]  # same on held-out rows (nan when there are none)
    rank: int | None = None  # rank of `delta` when reduced (None: full rank)
    factors: tuple | None = None  # (left [d_in, r], right [r, d_out]) with delta = left @
    # right, when the rank is reduced (what a server stores); None otherwise


class GramEig(NamedTuple):
    """Everything a ridge solve needs, from one pass over the rows."""

    eigvals: np.ndarray  # [d] of X^T X, ascending, clipped at 0
    eigvecs: np.ndarray  # [d, d]
    proj: np.ndarray  # [d, d_out] = V^T X^T Y
    y_sq: float  # ||Y||^2
    n: int
    scale: float  # mean eigenvalue trace(G)/d: lam = alpha * scale


def _check(x, y, name="x") -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    if x.ndim != 2 or y.ndim != 2:
        raise ValueError(f"{name} and its targets must be 2-D [rows, features], got "
                         f"{x.shape=} {y.shape=}")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"{name} has {x.shape[0]} rows but the targets have {y.shape[0]}")
    if x.shape[0] == 0:
        raise ValueError(f"{name} has no rows: a ridge fit needs at least one probe token")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise FloatingPointError(f"{name} or its targets contain NaN/inf")
    return x, y


def _moments(x, y) -> tuple[np.ndarray, np.ndarray, float]:
    """Sufficient statistics of a ridge fit: X^T X, X^T Y, ||Y||^2."""
    return x.T @ x, x.T @ y, float(np.sum(y * y))


def _eig(gram, xty, y_sq, n) -> GramEig:
    eigvals, eigvecs = scipy.linalg.eigh(gram, driver="evr")
    eigvals = np.clip(eigvals, 0.0, None)
    scale = float(np.trace(gram)) / gram.shape[0]
    return GramEig(eigvals, eigvecs, eigvecs.T @ xty, y_sq, n, scale)


def gram_eig(x, y) -> GramEig:
    x, y = _check(x, y)
    return _eig(*_moments(x, y), x.shape[0])


def _inverse_eigs(e: GramEig, lam: float, rtol: float = 1e-10) -> np.ndarray:
    if lam > 0:
        return 1.0 / (e.eigvals + lam)
    cutoff = rtol * max(float(e.eigvals[-1]), 0.0)
    safe = np.where(e.eigvals > cutoff, e.eigvals, 1.0)
    return np.where(e.eigvals > cutoff, 1.0 / safe, 0.0)  # pseudo-inverse on the null space


def solve(e: GramEig, lam: float) -> np.ndarray:
    if not lam >= 0:
        raise ValueError(f"lam must be >= 0, got {lam}")
    if math.isinf(lam) or e.scale == 0.0:
        return np.zeros_like(e.proj)  # infinite penalty, or all-zero inputs: no patch
    return e.eigvecs @ (_inverse_eigs(e, lam)[:, None] * e.proj)


def ridge_solve(x, y, lam: float) -> np.ndarray:
    """(X^T X + lam I)^-1 X^T Y in float64 (minimum-norm least squares when lam == 0)."""
    return solve(gram_eig(x, y), lam)


def residual_sq(e: GramEig, lam: float) -> float:
    """||Y - X D(lam)||^2 on the rows `e` was built from, from the eigenvalues alone."""
    if math.isinf(lam):
        return e.y_sq
    inv = _inverse_eigs(e, lam)
    c = np.sum(e.proj ** 2, axis=1)
    return max(e.y_sq - float(np.sum(c * (2 * inv - e.eigvals * inv ** 2))), 0.0)


def gcv_score(e: GramEig, lam: float) -> float:
    """Generalised cross-validation: (RSS / n) / (1 - df / n)^2, df = trace of the hat."""
    if math.isinf(lam):
        return e.y_sq / e.n
    df = float(np.sum(e.eigvals * _inverse_eigs(e, lam)))
    if df >= e.n:
        return math.inf
    return residual_sq(e, lam) / e.n / (1.0 - df / e.n) ** 2


def _rel(err_sq: float, ref_sq: float) -> float:
    return math.sqrt(err_sq / ref_sq) if ref_sq > 0 else 0.0


def single_blas_thread():
    """Context: numpy/scipy BLAS on one thread (d ~ 600 solves are fastest so, and immune
    to oversubscription)."""
    return threadpool_limits(limits=1)


def fit_ridge(x, y, holdout=None, config: RidgeConfig = RidgeConfig()) -> RidgeFit:
    """Fit D with X D ~ Y; `holdout` (bool [rows]) marks rows used to choose alpha."""
    with single_blas_thread():
        return _fit_ridge(x, y, holdout, config)


def _lam(alpha: float, scale: float) -> float:
    return math.inf if math.isinf(alpha) else alpha * scale


def _fit_ridge(x, y, holdout, config) -> RidgeFit:
    x, y = _check(x, y)
    holdout = np.zeros(x.shape[0], bool) if holdout is None else np.asarray(holdout, bool)
    if holdout.shape != (x.shape[0],):
        raise ValueError(f"holdout must be a bool mask of {x.shape[0]} rows, got "
                         f"{holdout.shape}")
    candidates = list(config.alphas) + ([math.inf] if config.allow_zero else [])
    val_err, rank = (math.nan, math.nan), None
    if config.selection == "holdout":
        if holdout.all() or not holdout.any():
            raise ValueError("selection='holdout' needs some (not all) rows held out; give "
                             "at least two probe sequences, or use selection='gcv'")
        fit, val = _moments(x[~holdout], y[~holdout]), _moments(x[holdout], y[holdout])
        (alpha, rank), val_err = _select_holdout(_eig(*fit, int((~holdout).sum())),
                                                 x[holdout], y[holdout], candidates,
                                                 config.ranks, _full_rank_allowed(config, x, y))
        stats = tuple(a + b for a, b in zip(fit, val))  # all rows, without a second pass
    else:
        stats = _moments(x, y)
        if config.selection == "gcv":
            e = _eig(*stats, x.shape[0])
            alpha = min(candidates, key=lambda a: gcv_score(e, _lam(a, e.scale)))
        else:
            alpha = config.alpha
    delta, lam, train, factors = _final_solve(*stats, alpha, x, y, rank)
    if not np.all(np.isfinite(delta)):
        raise FloatingPointError("ridge solution is not finite")
    return RidgeFit(delta, float(alpha), float(lam), train, val_err, rank, factors)


def _full_rank_allowed(config: RidgeConfig, x, y) -> bool:
    """A rank cap at or above the largest possible rank is no cap."""
    return config.allow_full_rank or max(config.ranks) >= min(x.shape[1], y.shape[1])


def _select_holdout(e: GramEig, x_val, y_val, candidates, ranks=(), full_rank=True):
    """(alpha, rank) with the least squared error on the held-out rows (rank None = full);
    (before, after) relative errors.

    With Xv = x_val V (eigenbasis), P = proj and D = diag(1 / (s + lam)), the held-out
    prediction is Xv D P, so ||y_val - Xv D P||^2 = ||y_val||^2 - 2 sum_i D_i a_i +
    sum_ij D_i D_j B_ij M_ij with a_i = <(Xv^T y_val)_i, P_i>, B = Xv^T Xv, M = P P^T:
    three matrix products once, then O(d^2) per candidate alpha.
    """
    xv = x_val @ e.eigvecs
    y_val_sq = float(np.sum(y_val * y_val))
    a = np.sum((xv.T @ y_val) * e.proj, axis=1)
    bm = (xv.T @ xv) * (e.proj @ e.proj.T)

    def held_out_sq(alpha):
        if math.isinf(alpha) or e.scale == 0.0:
            return y_val_sq
        inv = _inverse_eigs(e, _lam(alpha, e.scale))
        return max(y_val_sq - 2 * float(inv @ a) + float(inv @ bm @ inv), 0.0)

    errs = {(alpha, None): held_out_sq(alpha) for alpha in candidates
            if full_rank or math.isinf(alpha)}
    for alpha in candidates:
        if ranks and math.isfinite(alpha):  # scale 0 (zero inputs): zero patch, no NaN
            inv = _inverse_eigs(e, _lam(alpha, e.scale))
            for r, err in _reduced_rank_held_out(inv, e.proj, xv, y_val, ranks).items():
                errs[(alpha, r)] = err
    best = min(errs, key=errs.get)
    return best, (_rel(y_val_sq, y_val_sq), _rel(errs[best], y_val_sq))


def _rank_basis(inv: np.ndarray, proj: np.ndarray) -> np.ndarray:
    """Right singular vectors (columns, by decreasing singular value) of the augmented
    fitted values [X; sqrt(lam) I] D for D = V diag(inv) P: their Gram matrix is
    D^T (G + lam I) D = P^T diag(inv) P."""
    _, w = scipy.linalg.eigh(proj.T @ (inv[:, None] * proj), driver="evr")
    return w[:, ::-1]


def _reduced_rank_held_out(inv, proj, xv, y_val, ranks) -> dict:
    """Held-out squared error of D W_r W_r^T for every rank r < d_out, from one basis:
    ||Y - Z_r W_r^T||^2 = ||Y||^2 + sum_{j<r} (||z_j||^2 - 2 <(Y W)_j, z_j>), Z = Xv D W."""
    w = _rank_basis(inv, proj)
    z = xv @ (inv[:, None] * proj) @ w
    per_component = np.sum(z * z, axis=0) - 2 * np.sum((y_val @ w) * z, axis=0)
    cumulative = float(np.sum(y_val * y_val)) + np.cumsum(per_component)
    return {r: max(float(cumulative[r - 1]), 0.0) for r in ranks if r < w.shape[1]}


def _final_solve(gram, xty, y_sq, alpha, x, y, rank=None):
    """Fit on all rows with the chosen alpha (Cholesky when lam > 0: one factorisation),
    then project to `rank` (reduced-rank ridge) when given, returning its two factors
    too (else None)."""
    scale = float(np.trace(gram)) / gram.shape[0]
    lam = _lam(alpha, scale)
    factors = None
    if math.isinf(lam) or scale == 0.0:
        delta = np.zeros_like(xty)
    elif rank is not None:
        e = _eig(gram, xty, y_sq, x.shape[0])
        inv = _inverse_eigs(e, lam)
        w = _rank_basis(inv, e.proj)[:, :rank]
        factors = (e.eigvecs @ (inv[:, None] * e.proj) @ w, np.ascontiguousarray(w.T))
        delta = factors[0] @ factors[1]
    elif lam > 0:
        delta = scipy.linalg.cho_solve(scipy.linalg.cho_factor(
            gram + lam * np.eye(gram.shape[0])), xty)
    else:
        delta = solve(_eig(gram, xty, y_sq, x.shape[0]), 0.0)
    rss = y_sq - 2 * float(np.sum(delta * xty)) + float(np.sum(delta * (gram @ delta)))
    return delta, lam, (_rel(y_sq, y_sq), _rel(max(rss, 0.0), y_sq)), factors
