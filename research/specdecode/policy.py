"""Adaptive draft length: pick k per step to maximise expected tokens per unit of time.

Shapes are static under jit, so k comes from a small set `draft_lengths` (one compiled
branch each, selected in place in the loop; k = 0 is a plain decode step). Each row keeps a
running estimate of its per-token acceptance rate alpha per confidence class (the
drafter's `Availability.bucket`, e.g. the matched n-gram size): decayed counts of accepted
drafts and of rejections, with a Beta prior of `prior_strength` pseudo-drafts at
`prior_accept`. A draft of k tokens, of which row b can supply a_b, yields in expectation
E_b(k) = sum_{i=0..min(k, a_b)} alpha_b^i tokens (the correction/bonus token included),
and the step costs `costs[k]` (measured wall time of one step with k drafted tokens,
relative to k = 0: verifying k + 1 tokens and, for model drafters, drafting). The step
uses the k maximising sum_b E_b(k) / costs[k] over active rows.

Counts of a class decay by `decay` each time it is used (recent evidence wins when a text
starts or stops repeating itself) and all counts by `forget` every step, so a class whose
drafts failed drifts back to the prior and is tried again later.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


@dataclasses.dataclass(frozen=True)
class DraftLengthPolicy:
    """Static (hashable) settings of the draft-length choice.

    draft_lengths: the k a step may use, increasing, starting at 0 (plain decode step).
    costs: wall time of a step with each k relative to k = 0 (same length as
      draft_lengths); measure them with `specdecode.measure_step_costs` on your hardware.
      None: 1 + 0.1 k, a guess for memory-bound decoding.
    adaptive: False always drafts max(draft_lengths) when some row can draft (otherwise a
      plain step): the fixed-k baseline.
    """

    draft_lengths: tuple[int, ...] = (0, 1, 2, 4, 8)
    costs: tuple[float, ...] | None = None
    adaptive: bool = True
    prior_accept: float = 0.5
    prior_strength: float = 1.0
    decay: float = 0.9
    forget: float = 0.98

    def __post_init__(self):
        ks = self.draft_lengths
        if not ks or ks[0] != 0 or any(b <= a for a, b in zip(ks, ks[1:])):
            raise ValueError(f"draft_lengths must start at 0 and increase, got {ks}")
        if self.costs is not None:
            if len(self.costs) != len(ks):
                raise ValueError(f"costs has {len(self.costs)} entries, expected one per "
                                 f"draft length {ks}")
            if any(not c > 0 for c in self.costs):
                raise ValueError(f"costs must be positive, got {self.costs}")
        if not 0.0 < self.prior_accept < 1.0:
            raise ValueError(f"prior_accept must be in (0, 1), got {self.prior_accept}")
        if not self.prior_strength > 0:
            raise ValueError(f"prior_strength must be > 0, got {self.prior_strength}")
        for name in ("decay", "forget"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    @property
    def max_draft(self) -> int:
        return self.draft_lengths[-1]

    @property
    def step_costs(self) -> tuple[float, ...]:
        if self.costs is not None:
            return tuple(c / self.costs[0] for c in self.costs)
        return tuple(1.0 + 0.1 * k for k in self.draft_lengths)

    def with_costs(self, costs) -> "DraftLengthPolicy":
        return dataclasses.replace(self, costs=tuple(float(c) for c in costs))


class AcceptanceStats(NamedTuple):
    accepted: Float[Array, "B C"]  # decayed count of accepted drafted tokens per class
    rejected: Float[Array, "B C"]  # decayed count of rejections (at most one per step)


def init_stats(batch: int, n_buckets: int = 1) -> AcceptanceStats:
    z = jnp.zeros((batch, n_buckets), jnp.float32)
    return AcceptanceStats(z, z)


def acceptance_rate(policy: DraftLengthPolicy, stats: AcceptanceStats) -> Array:
    """Posterior-mean per-token acceptance rate per row and class [B, C]."""
    a = stats.accepted + policy.prior_strength * policy.prior_accept
    return a / (stats.accepted + stats.rejected + policy.prior_strength)


def update_stats(policy: DraftLengthPolicy, stats: AcceptanceStats, bucket, n_drafted,
                 n_accepted, active) -> AcceptanceStats:
    """Forget a little everywhere; decay, then count, the class a row drafted from."""
    used = active[:, None] & (n_drafted[:, None] > 0) & (
        jnp.arange(stats.accepted.shape[1])[None, :] == bucket[:, None])
    d = jnp.where(active[:, None], policy.forget, 1.0) * jnp.where(used, policy.decay, 1.0)
    acc = stats.accepted * d + jnp.where(used, n_accepted[:, None], 0)
    rej = stats.rejected * d + (used & (n_accepted < n_drafted)[:, None])
    return AcceptanceStats(acc.astype(jnp.float32), rej.astype(jnp.float32))


def expected_tokens(alpha: Float[Array, "B"], n_avail: Int[Array, "B"], k: int) -> Array:
    """E[tokens emitted] when row b drafts min(k, n_avail[b]) tokens: sum_i alpha^i."""
    i = jnp.arange(k + 1)[None, :]
    terms = jnp.where(i <= jnp.minimum(n_avail, k)[:, None], alpha[:, None] ** i, 0.0)
    return jnp.sum(terms, axis=1)


def choose_branch(policy: DraftLengthPolicy, stats: AcceptanceStats, n_avail: Int[Array, "B"],
                  bucket: Int[Array, "B"], active) -> Array:
    """Index into `policy.draft_lengths` for this step (int32 scalar)."""
    ks = policy.draft_lengths
    can_draft = jnp.any(active & (n_avail > 0))
    if not policy.adaptive:
        return jnp.where(can_draft, len(ks) - 1, 0).astype(jnp.int32)
    alpha = jnp.take_along_axis(acceptance_rate(policy, stats), bucket[:, None], axis=1)[:, 0]
    costs = policy.step_costs
    rates = jnp.stack([jnp.sum(jnp.where(active, expected_tokens(alpha, n_avail, k), 0.0))
                       / costs[j] for j, k in enumerate(ks)])
    return jnp.where(can_draft, jnp.argmax(rates), 0).astype(jnp.int32)
