"""Replication planner, baselines, skew generator, metrics and the step-time model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.megaflux import baselines, cost_model, metrics, planner, skew

plan_jit = jax.jit(planner.plan_replicas, static_argnums=(1, 2, 3))


def _zipf_loads(seed, e=64, k=4, tokens=2048, zipf=1.2, drift=0.0):
    ids = skew.synthetic_routing(skew.SkewSpec(zipf=zipf, drift=drift), e, k, tokens, 1, seed)
    return np.bincount(ids.ravel(), minlength=e)


def _check_plan(plan, loads, d, s):
    plan = jax.tree.map(np.asarray, plan)
    per = len(loads) // d
    total = plan.home_tokens.copy()
    for dev in range(d):
        used = plan.slot_expert[dev][plan.slot_expert[dev] >= 0]
        assert len(set(used)) == len(used), "an expert twice on one device"
        assert not (used // per == dev).any(), "a replica on its home device"
        for e, t in zip(plan.slot_expert[dev], plan.slot_tokens[dev]):
            if e >= 0:
                total[e] += t
            else:
                assert t == 0
    np.testing.assert_array_equal(total, loads)  # every assignment placed exactly once
    assert (plan.home_tokens >= 0).all() and (plan.slot_tokens >= 0).all()


@pytest.mark.parametrize("zipf", [0.8, 1.2, 1.6])
def test_plan_balances_zipf_skew(zipf):
    loads = _zipf_loads(0, zipf=zipf)
    plan = plan_jit(jnp.asarray(loads, jnp.int32), 8, 2, 1)
    _check_plan(plan, loads, 8, 2)
    static = metrics.gamma(planner.device_loads(planner.static_plan(jnp.asarray(loads), 8)))
    g = metrics.gamma(planner.device_loads(plan))
    assert static > 1.3 and g <= 1.10, (static, g)


def test_plan_all_tokens_one_expert_and_empty_experts():
    loads = np.zeros(16, np.int64)
    loads[5] = 800
    plan = plan_jit(jnp.asarray(loads, jnp.int32), 8, 1, 1)
    _check_plan(plan, loads, 8, 1)
    np.testing.assert_array_equal(planner.device_loads(plan), np.full(8, 100))
    empty = plan_jit(jnp.zeros(16, jnp.int32), 8, 2, 1)
    assert (np.asarray(empty.slot_expert) == planner.EMPTY).all()


def test_route_to_instances_matches_plan_counts():
    rng = np.random.default_rng(3)
    loads = _zipf_loads(1, e=32, zipf=1.6)
    plan = plan_jit(jnp.asarray(loads, jnp.int32), 8, 3, 1)
    experts = np.repeat(np.arange(32), loads)
    ranks = np.concatenate([np.arange(n) for n in loads])
    perm = rng.permutation(len(experts))
    dev, grp = jax.jit(planner.route_to_instances)(plan, jnp.asarray(experts[perm]),
                                                   jnp.asarray(ranks[perm]))
    got = np.zeros((8, 4 + 3), np.int64)
    np.add.at(got, (np.asarray(dev), np.asarray(grp)), 1)
    p = jax.tree.map(np.asarray, plan)
    want = np.concatenate([p.home_tokens.reshape(8, 4), p.slot_tokens], axis=1)
    np.testing.assert_array_equal(got, want)
    hist = skew.per_device_histograms(experts[perm][None, :len(perm) // 8 * 8, None], 8, 32)[0]
    counts = np.asarray(jax.jit(planner.instance_counts)(plan, jnp.asarray(hist)))
    assert counts.sum() == hist.sum()
    np.testing.assert_array_equal(counts.sum(axis=0), want)


def test_planner_errors():
    with pytest.raises(ValueError, match="multiple of the 8"):
        planner.plan_replicas(jnp.ones(12, jnp.int32), 8, 1)
    with pytest.raises(ValueError, match="replica_slots must be >= 0"):
        planner.plan_replicas(jnp.ones(16, jnp.int32), 8, -1)
    with pytest.raises(ValueError, match="exceeds"):
        planner.plan_replicas(jnp.ones(16, jnp.int32), 8, 15)
    with pytest.raises(ValueError, match="min_replica_tokens"):
        planner.plan_replicas(jnp.ones(16, jnp.int32), 8, 1, 0)
    with pytest.raises(ValueError, match="holds no expert"):
        planner.slots_from_budget(1000, 4096)
    assert planner.slots_from_budget(3 * 4096 + 5, 4096) == 3


def test_skew_generator():
    spec = skew.SkewSpec(zipf=1.2, n_hot=4, drift=0.5)
    ids = skew.synthetic_routing(spec, 32, 4, 256, 6, seed=0)
    assert ids.shape == (6, 256, 4)
    assert all(len(set(row)) == 4 for row in ids[0])  # distinct experts per token
    np.testing.assert_array_equal(ids, skew.synthetic_routing(spec, 32, 4, 256, 6, seed=0))
    hot = [set(np.argsort(-np.bincount(s.ravel(), minlength=32))[:4]) for s in ids]
    assert hot[0] != hot[-1]  # the hot set drifted
    still = skew.synthetic_routing(skew.SkewSpec(zipf=1.2, n_hot=4), 32, 4, 4096, 3, seed=1)
    tops = [set(np.argsort(-np.bincount(s.ravel(), minlength=32))[:2]) for s in still]
    assert tops[0] == tops[1] == tops[2]
    with pytest.raises(ValueError, match="drift"):
        skew.SkewSpec(drift=1.5)
    with pytest.raises(ValueError, match="top_k"):
        skew.sample_top_k(np.ones(4) / 4, 3, 5, np.random.default_rng(0))


def test_eplb_and_capacity_baselines():
    loads = _zipf_loads(2, zipf=1.2)
    placement = baselines.eplb_placement(loads.astype(float), 8, 2)
    plan = baselines.even_split_plan(loads, placement)
    _check_plan(plan, loads, 8, 2)
    assert metrics.gamma(planner.device_loads(plan)) < metrics.gamma(
        planner.device_loads(planner.static_plan(jnp.asarray(loads), 8)))
    eplb = baselines.EPLB(8, 2, interval=2)
    first, changed = eplb.step(loads)
    assert (np.asarray(first.slot_expert) < 0).all() and changed == 0  # no history yet
    eplb.step(loads)
    _, changed = eplb.step(loads)
    assert changed > 0
    cap, dropped = baselines.capacity_plan(loads, 8, 1.0)
    assert dropped == (loads - np.minimum(loads, int(np.ceil(loads.mean())))).sum() > 0
    with pytest.raises(ValueError, match="capacity_factor"):
        baselines.capacity_plan(loads, 8, 0.0)


def test_metrics_and_cost_model():
    assert metrics.gamma([1, 1, 2]) == pytest.approx(1.5)
    assert metrics.max_vio([1, 3]) == pytest.approx(0.5)
    loads = _zipf_loads(4, zipf=1.6) * 32  # 64k tokens x top-4: replicas pay off
    hist = np.stack([np.bincount(np.repeat(np.arange(64), loads)[i::8], minlength=64)
                     for i in range(8)])
    static = planner.static_plan(jnp.asarray(loads, jnp.int32), 8)
    mf = plan_jit(jnp.asarray(loads, jnp.int32), 8, 2, 1)
    for node in cost_model.NODES.values():
        t_static = cost_model.step_times(static, jnp.asarray(hist), node,
                                         cost_model.DEEPSEEK_V3_EXPERT)
        t_mf = cost_model.step_times(mf, jnp.asarray(hist), node,
                                     cost_model.DEEPSEEK_V3_EXPERT, planner_s=1e-4)
        assert t_mf["fwd_s"] < t_static["fwd_s"] and t_mf["bwd_s"] < t_static["bwd_s"]
        assert t_static["bwd_s"] > t_static["fwd_s"]
    assert metrics.replica_bytes(np.asarray(mf.slot_expert), 10) == 10 * int(
        (np.asarray(mf.slot_expert) >= 0).sum())
