"""Covariance-aware channel grouping: which channels share a VQ sub-vector.

With the same number of bits per group, the high-resolution distortion of a Gaussian
group with covariance S_g of n channels is ~ n * det(S_g)^(1/n) * 2^(-2 b / n). Grouping
therefore minimises sum_g det(S_g)^(1/n): it puts correlated channels together (their
determinant is small) and spreads high-variance channels over groups (each group spends
its bits where its variance is).

Keys are grouped in units of RoPE pairs (i, i + D/2): a pair rotates as one 2-D point,
so keeping it in one group lets a codebook learn that ring instead of two marginals.
Values have no RoPE and are grouped channel by channel.

The permutation is applied inside the codec (codes are stored in permuted order; queries
and outputs are re-indexed per call, D elements), never folded into W_q/W_k: a pair's
rotation frequency is tied to its channel index, so permuting projection columns would
change the model.
"""
from __future__ import annotations

import numpy as np


def rope_pair_units(head_dim: int) -> list[tuple[int, ...]]:
    half = head_dim // 2
    return [(i, i + half) for i in range(half)]


def channel_units(head_dim: int) -> list[tuple[int, ...]]:
    return [(i,) for i in range(head_dim)]


def group_cost(cov: np.ndarray, groups: list[list[int]]) -> float:
    """sum_g det(S_g)^(1/n) (geometric-mean eigenvalue per group)."""
    total = 0.0
    for g in groups:
        sign, logdet = np.linalg.slogdet(cov[np.ix_(g, g)])
        total += np.exp(logdet / len(g)) if sign > 0 else 0.0
    return float(total)


def _group_costs(cov: np.ndarray, channels: np.ndarray) -> np.ndarray:
    """det(S_g)^(1/n) for a batch of channel index sets [..., n]."""
    n = channels.shape[-1]
    blocks = cov[channels[..., :, None], channels[..., None, :]]
    sign, logdet = np.linalg.slogdet(blocks)
    return np.where(sign > 0, np.exp(logdet / n), 0.0)


def covariance_grouping(cov: np.ndarray, group_size: int, units: list[tuple[int, ...]],
                        max_sweeps: int = 100, ridge: float = 1e-6) -> np.ndarray:
    """Permutation [D] whose consecutive runs of `group_size` channels are the groups.

    Start: units sorted by variance dealt round-robin into groups (balances variance);
    then, repeatedly, the best swap of two units between two groups (all candidates
    scored in one batched slogdet) until no swap lowers the cost.
    """
    d = cov.shape[0]
    unit = len(units[0])
    if any(len(u) != unit for u in units) or sorted(c for u in units for c in u) != list(
            range(d)):
        raise ValueError("units must partition range(D) into tuples of one size")
    if group_size % unit or d % group_size:
        raise ValueError(f"group_size={group_size} must be a multiple of the unit size "
                         f"{unit} and divide head_dim={d}")
    cov = np.asarray(cov, np.float64)
    cov = cov + ridge * np.trace(cov) / d * np.eye(d)
    unit_ch = np.asarray(units, np.int64)  # [U, unit]
    per_group, n_groups = group_size // unit, d // group_size
    var = np.array([cov[u, u].sum() for u in unit_ch])
    order = np.argsort(-var, kind="stable")
    members = np.stack([order[g::n_groups] for g in range(n_groups)])  # [n_groups, per_group]
    ga, gb, ia, ib = (a.reshape(-1) for a in np.meshgrid(
        np.arange(n_groups), np.arange(n_groups), np.arange(per_group), np.arange(per_group),
        indexing="ij"))
    keep = ga < gb
    ga, gb, ia, ib = ga[keep], gb[keep], ia[keep], ib[keep]
    rows = np.arange(len(ga))
    for _ in range(max_sweeps if n_groups > 1 else 0):  # one group: nothing to swap
        costs = _group_costs(cov, unit_ch[members].reshape(n_groups, group_size))
        new_a, new_b = members[ga].copy(), members[gb].copy()
        new_a[rows, ia], new_b[rows, ib] = members[gb, ib], members[ga, ia]
        delta = (_group_costs(cov, unit_ch[new_a].reshape(len(ga), group_size))
                 + _group_costs(cov, unit_ch[new_b].reshape(len(ga), group_size))
                 - costs[ga] - costs[gb])
        best = int(np.argmin(delta))
        if delta[best] >= -1e-9 * costs.sum():
            break
        members[ga[best]], members[gb[best]] = new_a[best], new_b[best]
    groups = [np.sort(unit_ch[np.sort(m)].reshape(-1)) for m in members]
    return np.concatenate(groups).astype(np.int32)
