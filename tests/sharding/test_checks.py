"""The HLO collective reader, the roofline model and the paged layout's ownership check."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from research.kv.paged import PagedKVCache, with_block_tables
from research.model import forward, init_params, make_model, tiny_config
from research.sharding import (H200, LLAMA31_8B, SMOLLM2_135M, TPU_V5E, collective_summary,
                               gathers_of, make_mesh, modeled_decode_step, modeled_layouts,
                               override_rules, shard_model)


def test_gathers_of_finds_a_parameter_assembled_on_every_device():
    mesh = make_mesh(tensor=8)
    w = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P(None, "tensor")))
    gather = jax.jit(lambda w: w * 2, out_shardings=NamedSharding(mesh, P()))
    text = gather.lower(w).compile().as_text()
    assert [c.shape for c in gathers_of(text, {"w": w})] == [(64, 32)]
    assert collective_summary(text)["all-gather"]["bytes"] == 64 * 32 * 4
    keep = jax.jit(lambda w: w * 2, out_shardings=NamedSharding(mesh, P(None, "tensor")))
    assert gathers_of(keep.lower(w).compile().as_text(), {"w": w}) == []


def test_roofline_model_terms():
    r = modeled_decode_step(SMOLLM2_135M, TPU_V5E, dp=1, tp=1, batch=8, context=1024)
    assert r["bound"] == "memory" and r["t_comm_ms"] == 0.0
    weights = 134_515_008 * 2  # SmolLM2's parameter count in bf16
    kv = 8 * 1024 * 2 * 30 * 3 * 64 * 2
    assert r["t_mem_ms"] == pytest.approx((weights + kv) / (819e9 * 0.8) * 1e3)
    tp = modeled_decode_step(LLAMA31_8B, H200, dp=1, tp=8, batch=64, context=4096)
    one = modeled_decode_step(LLAMA31_8B, H200, dp=1, tp=1, batch=64, context=4096)
    assert tp["t_comm_ms"] > 0 and 1 < one["step_ms"] / tp["step_ms"] < 8
    assert not modeled_decode_step(LLAMA31_8B, TPU_V5E, 1, 1, 64, 4096)["fits"]
    assert modeled_layouts(SMOLLM2_135M, 8) == [(8, 1), (2, 3)]
    with pytest.raises(ValueError, match="tp=2 must divide n_kv_heads=3"):
        modeled_decode_step(SMOLLM2_135M, H200, dp=1, tp=2, batch=8, context=64)


def test_paged_row_pointing_at_another_shards_blocks_gets_nan_not_a_wrong_page():
    """data 2, 2 rows x 2 blocks: shard 0 owns blocks [0, 2), shard 1 blocks [2, 4). Row 0
    (shard 0) mapped onto block 3 would read shard 1's page: its output is NaN; row 1
    stays finite."""
    config = tiny_config(n_layers=1, vocab_size=96)
    model = make_model(config, init_params(config, jax.random.key(0)))
    model = model.replace(caches=(PagedKVCache(block_size=4),))
    sharded = shard_model(model, make_mesh(data=2), override_rules(vocab=None))
    states = sharded.init_cache(2, 8)
    assert np.asarray(states[0]["block_table"]).tolist() == [[0, 1], [2, 3]]
    tokens = jnp.asarray(np.arange(8).reshape(2, 4), jnp.int32)
    run = jax.jit(lambda m, t, s: forward(m, t, cache_states=s, logits="last").logits)
    ok = run(sharded, tokens, states)
    assert bool(jnp.isfinite(ok).all())
    bad = with_block_tables(states, jnp.asarray([[3, 1], [2, 3]]))  # row 0 -> shard 1's block 3
    out = np.asarray(run(sharded, tokens, bad))
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()


def test_tensor_parallel_only_paged_pool_serves_any_block_table():
    """With batch/blocks replicated (rules batch=None, blocks=None) the pool is split by
    KV heads only, so rows may share and reorder blocks freely (what a serving engine's
    prefix cache does): same logits as one device."""
    config = tiny_config(n_layers=1, vocab_size=96, n_heads=4, n_kv_heads=2)
    model = make_model(config, init_params(config, jax.random.key(1)))
    model = model.replace(caches=(PagedKVCache(block_size=4, n_blocks=6),))
    rules = override_rules(vocab=None, batch=None, blocks=None)
    sharded = shard_model(model, make_mesh(tensor=2), rules)
    table = jnp.asarray([[5, 0], [5, 2]])  # both rows' first page is block 5 (shared)
    tokens = jnp.asarray([[1, 2, 3, 4], [1, 2, 3, 4]], jnp.int32)
    run = jax.jit(lambda m, t, s: forward(m, t, cache_states=s, logits="last").logits)
    want = run(model, tokens, with_block_tables(model.init_cache(2, 8), table))
    states = with_block_tables(sharded.init_cache(2, 8), table)
    assert states[0]["k"].sharding.spec == P(None, None, "tensor", None)
    np.testing.assert_allclose(run(sharded, tokens, states), want, atol=1e-5, rtol=1e-5)
