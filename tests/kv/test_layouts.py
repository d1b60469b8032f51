"""Dense and window caches against the reference attention over the full history."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from research.kv.codec import FloatCodec
from research.kv.dense import DenseKVCache
from research.kv.memory import kv_cache_bytes, kv_bytes_per_token, max_batch
from research.kv.window import WindowKVCache
from research.model import init_params, make_model, tiny_config
from research.core.attention import attend

B, HQ, HKV, D = 2, 4, 2, 8


def _chunk(key, t):
    kq, kk, kv = jax.random.split(jax.random.key(key), 3)
    return (jax.random.normal(kq, (B, t, HQ, D)), jax.random.normal(kk, (B, t, HKV, D)),
            jax.random.normal(kv, (B, t, HKV, D)))


def _np_attention(q, k, v, q_pos, window):
    """Plain numpy causal GQA attention of q [n, HQ, D] over the history k, v [s, HKV, D]."""
    g = HQ // HKV
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # [s, HQ, D]
    scores = np.einsum("nhd,shd->hns", q, kk) / np.sqrt(D)
    kv_pos = np.arange(k.shape[0])
    mask = kv_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= q_pos[:, None] - kv_pos[None, :] < window
    scores = np.where(mask[None], scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("hns,shd->nhd", w, vv)


T = 6  # every chunk is padded to T tokens: one compile, and padding gets exercised


def _run_chunks(cache, n_new_rows, window, max_len=32):
    """Feed padded chunks through `cache`; compare each with full-history attention."""
    state = cache.init(B, max_len, HKV, D)
    start = np.zeros((B,), np.int32)
    hist_k, hist_v = [np.zeros((0, HKV, D))] * B, [np.zeros((0, HKV, D))] * B
    step_fn = jax.jit(cache.update_and_attend, static_argnames="window")
    for step, n_new in enumerate(n_new_rows):
        q, k, v = (np.asarray(x) for x in _chunk(step, T))
        n_new = np.asarray(n_new, np.int32)
        out, state = step_fn(state, q, k, v, start=jnp.asarray(start),
                             n_new=jnp.asarray(n_new), window=window)
        for b in range(B):
            n = int(n_new[b])
            hist_k[b] = np.concatenate([hist_k[b], k[b, :n]])
            hist_v[b] = np.concatenate([hist_v[b], v[b, :n]])
            if n:
                ref = _np_attention(q[b, :n], hist_k[b], hist_v[b], start[b] + np.arange(n),
                                    window)
                np.testing.assert_allclose(out[b, :n], ref, atol=1e-5)
        start = start + n_new


chunks = st.lists(st.tuples(st.integers(0, T), st.integers(0, T)), min_size=1, max_size=4)


@settings(max_examples=10, deadline=None)
@given(chunks)
def test_dense_matches_reference(rows):
    _run_chunks(DenseKVCache(), rows, window=None)


@pytest.mark.parametrize("window", [1, 3, 5])
@settings(max_examples=6, deadline=None)
@given(rows=chunks)
def test_window_ring_matches_reference(rows, window):
    _run_chunks(WindowKVCache(window=window), rows, window=window)


def test_dense_with_window_mask_matches_reference():
    _run_chunks(DenseKVCache(), [(5, 3), (1, 1), (0, 1), (4, 2), (6, 6)], window=3)


def test_bf16_cache_stores_bf16():
    state = DenseKVCache(FloatCodec("bfloat16")).init(1, 4, 1, 2)
    assert state["k"].dtype == jnp.bfloat16


def test_window_cache_rejects_larger_window():
    cache = WindowKVCache(window=2)
    q, k, v = _chunk(0, 1)
    with pytest.raises(ValueError, match="window=3"):
        cache.update_and_attend(cache.init(B, 8, HKV, D), q, k, v, start=jnp.zeros(B, int),
                                n_new=jnp.ones(B, int), window=3)


def test_bad_cache_args():
    with pytest.raises(ValueError, match="dtype"):
        FloatCodec("int8")
    with pytest.raises(ValueError, match="window"):
        WindowKVCache(window=0)


def test_memory_accounting_matches_real_arrays():
    config = tiny_config(layer_kinds=("sliding", "global"), sliding_window=4)
    model = make_model(config, init_params(config, jax.random.key(0)))
    real = sum(x.nbytes for x in jax.tree.leaves(model.init_cache(3, 16)))
    assert kv_cache_bytes(model, 3, 16) == real
    # global layer: 2 (K,V) * Hkv * D * 4 B per token; sliding layer: a 4-slot ring + pos
    per_token_global = 2 * config.n_kv_heads * config.head_dim * 4
    ring = 4 * (2 * config.n_kv_heads * config.head_dim * 4 + 4)
    assert kv_bytes_per_token(model, 16) == per_token_global + ring / 16
    budget = 10 * kv_cache_bytes(model, 1, 16)
    assert max_batch(model, budget, 16) == 10


def test_max_batch_bad_budget(tiny):
    with pytest.raises(ValueError, match="budget_bytes"):
        max_batch(tiny, 0, 16)
