"""Adaptive draft length: choices follow acceptance per confidence class and the costs."""
import jax.numpy as jnp
import numpy as np
import pytest

from research.specdecode import policy as pol
from research.specdecode.costs import linear_cost_fit

POLICY = pol.DraftLengthPolicy(draft_lengths=(0, 1, 2, 4, 8), costs=(1, 1.1, 1.2, 1.4, 1.8))
ACTIVE = jnp.array([True])


def _stats(accepted, rejected, n_buckets=2):
    s = pol.init_stats(1, n_buckets)
    return pol.AcceptanceStats(s.accepted.at[0, 0].set(accepted),
                               s.rejected.at[0, 0].set(rejected))


def _choice(stats, n_avail=8, bucket=0, policy=POLICY):
    b = pol.choose_branch(policy, stats, jnp.array([n_avail]), jnp.array([bucket]), ACTIVE)
    return policy.draft_lengths[int(b)]


def test_choice_follows_acceptance_and_availability():
    assert _choice(_stats(40.0, 1.0)) == 8  # copying: draft the most
    assert _choice(_stats(0.0, 20.0)) == 0  # drafts keep failing: plain decoding
    assert 0 < _choice(_stats(3.0, 3.0)) < 8  # middling: a short draft
    assert _choice(_stats(40.0, 1.0), n_avail=0) == 0  # nothing to draft
    assert _choice(_stats(40.0, 1.0), n_avail=2) == 2  # no point paying for k = 8
    assert _choice(_stats(0.0, 20.0), bucket=1) > 0  # the other class is still at the prior


def test_fixed_policy_and_expensive_drafts():
    fixed = pol.DraftLengthPolicy(draft_lengths=(0, 4), adaptive=False)
    assert _choice(_stats(0.0, 50.0), policy=fixed) == 4
    assert _choice(_stats(0.0, 50.0), n_avail=0, policy=fixed) == 0
    dear = pol.DraftLengthPolicy(draft_lengths=(0, 1, 2), costs=(1.0, 3.0, 5.0))
    assert _choice(_stats(40.0, 1.0), policy=dear) == 0  # cannot pay back the cost


def test_update_stats_counts_the_used_class_and_forgets():
    p = pol.DraftLengthPolicy(decay=0.5, forget=0.9)
    s = pol.init_stats(2, 3)
    s = pol.update_stats(p, s, jnp.array([1, 2]), jnp.array([4, 0]), jnp.array([2, 0]),
                         jnp.array([True, True]))
    np.testing.assert_allclose(s.accepted, [[0, 2, 0], [0, 0, 0]])
    np.testing.assert_allclose(s.rejected, [[0, 1, 0], [0, 0, 0]])  # row 1 drafted nothing
    s = pol.update_stats(p, s, jnp.array([0, 0]), jnp.array([3, 0]), jnp.array([3, 0]),
                         jnp.array([True, False]))
    np.testing.assert_allclose(s.accepted, [[3, 2 * 0.9, 0], [0, 0, 0]])
    np.testing.assert_allclose(s.rejected, [[0, 0.9, 0], [0, 0, 0]])
    rate = pol.acceptance_rate(p, s)
    assert rate[0, 0] > rate[0, 1] > rate[0, 2] == 0.5  # class 2: never used, the prior


def test_expected_tokens():
    e = pol.expected_tokens(jnp.array([0.5, 1.0, 0.5]), jnp.array([8, 8, 1]), 2)
    np.testing.assert_allclose(e, [1.75, 3.0, 1.5])


def test_policy_validation_and_cost_fit():
    for bad in [dict(draft_lengths=()), dict(draft_lengths=(0, 2, 2)),
                dict(costs=(1.0,)), dict(costs=(1, 1, 1, 0, 1)), dict(prior_accept=1.0),
                dict(decay=1.5), dict(forget=-0.1), dict(prior_strength=0)]:
        with pytest.raises(ValueError):
            pol.DraftLengthPolicy(**bad)
    assert POLICY.max_draft == 8
    np.testing.assert_allclose(pol.DraftLengthPolicy(draft_lengths=(0, 2)).step_costs,
                               (1.0, 1.2))
    np.testing.assert_allclose(linear_cost_fit([0, 1, 2], [1.0, 1.1, 1.2]), [1.0, 1.1, 1.2])
    np.testing.assert_allclose(linear_cost_fit([0, 2], [1.0, 0.8]), [1.0, 1.0])  # slope >= 0


def test_measure_step_costs_times_every_draft_length(tiny):
    from research.specdecode import prompt_lookup
    from research.specdecode.costs import measure_step_costs
    out = measure_step_costs(tiny, prompt_lookup(), (0, 2), max_len=32, repeats=2)
    assert out["k"] == [0, 2]
    assert all(s > 0 for s in out["median_s"])
    assert out["relative"][0] == 1.0
    assert len(out["linear_fit"]) == 2
