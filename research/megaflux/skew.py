"""Synthetic routing skew for controlled sweeps: Zipf popularity, a hot set, and drift.

Popularity over ranks r = 1..E is Zipf, p(r) ~ r^-zipf. With `n_hot` set, only the top
n_hot ranks follow Zipf; the other ranks share the weight of rank n_hot + 1 (a flat
tail), so the skew is concentrated in n_hot experts. Ranks map to experts through a
permutation that *drifts*: each step, round(drift * n_hot) randomly chosen hot ranks swap
their expert with a random cold expert (drift=0: a fixed hot set; drift=1: a new hot set
every step). Each token picks top_k distinct experts by sampling without replacement from
the popularity (Gumbel top-k), as a softmax router with noisy logits would.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SkewSpec:
    zipf: float = 1.2  # Zipf exponent of expert popularity (0 = uniform)
    n_hot: int | None = None  # size of the hot set (None: Zipf over all experts)
    drift: float = 0.0  # fraction of the hot set replaced per step, in [0, 1]

    def __post_init__(self):
        if self.zipf < 0:
            raise ValueError(f"zipf must be >= 0, got {self.zipf}")
        if self.n_hot is not None and self.n_hot < 1:
            raise ValueError(f"n_hot must be None or >= 1, got {self.n_hot}")
        if not 0.0 <= self.drift <= 1.0:
            raise ValueError(f"drift must be in [0, 1], got {self.drift}")

    def label(self) -> str:
        hot = "" if self.n_hot is None else f" hot{self.n_hot}"
        return f"zipf{self.zipf:g}{hot} drift{self.drift:g}"


def rank_popularity(spec: SkewSpec, n_experts: int) -> np.ndarray:
    """[E] probabilities by popularity rank (rank 0 hottest)."""
    ranks = np.arange(1, n_experts + 1, dtype=np.float64)
    w = ranks ** -spec.zipf
    if spec.n_hot is not None and spec.n_hot < n_experts:
        w[spec.n_hot:] = (spec.n_hot + 1) ** -spec.zipf
    return w / w.sum()


def _hot_size(spec: SkewSpec, n_experts: int) -> int:
    return min(n_experts, spec.n_hot if spec.n_hot is not None else max(1, n_experts // 8))


def drifting_permutations(spec: SkewSpec, n_experts: int, n_steps: int,
                          rng: np.random.Generator) -> np.ndarray:
    """[steps, E]: expert at each popularity rank, per step."""
    perm = rng.permutation(n_experts)
    hot = _hot_size(spec, n_experts)
    out = np.empty((n_steps, n_experts), np.int64)
    for t in range(n_steps):
        if t and spec.drift > 0 and hot < n_experts:
            n_swap = int(round(spec.drift * hot))
            for r in rng.choice(hot, size=n_swap, replace=False):
                c = rng.integers(hot, n_experts)
                perm[r], perm[c] = perm[c], perm[r]
        out[t] = perm
    return out


def sample_top_k(expert_probs: np.ndarray, n_tokens: int, top_k: int,
                 rng: np.random.Generator) -> np.ndarray:
    """[n_tokens, top_k] distinct experts per token, sampled without replacement."""
    if not 1 <= top_k <= expert_probs.shape[0]:
        raise ValueError(f"top_k must be in [1, {expert_probs.shape[0]}], got {top_k}")
    gumbel = rng.gumbel(size=(n_tokens, expert_probs.shape[0]))
    keys = np.log(np.maximum(expert_probs, 1e-30))[None] + gumbel
    return np.argsort(-keys, axis=1)[:, :top_k]


def synthetic_routing(spec: SkewSpec, n_experts: int, top_k: int, n_tokens: int,
                      n_steps: int, seed: int) -> np.ndarray:
    """[steps, n_tokens, top_k] expert ids following `spec`."""
    rng = np.random.default_rng(seed)
    pop = rank_popularity(spec, n_experts)
    perms = drifting_permutations(spec, n_experts, n_steps, rng)
    steps = []
    for perm in perms:
        probs = np.empty(n_experts)
        probs[perm] = pop
        steps.append(sample_top_k(probs, n_tokens, top_k, rng))
    return np.stack(steps)


def per_device_histograms(expert_ids: np.ndarray, n_devices: int,
                          n_experts: int) -> np.ndarray:
    """[steps, D, E] histograms with tokens split evenly over source devices in order."""
    steps, n_tokens, _ = expert_ids.shape
    if n_tokens % n_devices:
        raise ValueError(f"{n_tokens} tokens per step do not split over {n_devices} devices")
    per = expert_ids.reshape(steps, n_devices, -1)
    hist = np.zeros((steps, n_devices, n_experts), np.int64)
    for t in range(steps):
        for d in range(n_devices):
            hist[t, d] = np.bincount(per[t, d], minlength=n_experts)
    return hist
