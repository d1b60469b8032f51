"""Evicting KV cache: exactness at ratio 1, budgets, per-policy choices vs plain numpy
references, decode over exactly the kept tokens, trimming, and bad input."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.eviction import press as eviction
from research.kv.base import KVCache
from research.kv.dense import DenseKVCache
from research.eviction.press import EvictingKVCache, evict, kept_tokens, trim_states
from research.eviction.policies import H2O, KeyNorm, SnapKV, StreamingLLM, make_policy
from research.kv.window import WindowKVCache
from research.model import forward, init_params, make_model, tiny_config
from research.core.attention import attend
from research.decode.generate import generate
from research.model.precision import kv_cache_dtype
from research.transforms import calibrate_and_apply, chain

forward = jax.jit(forward, static_argnames=("logits", "capture"))  # one compile per shape
POLICIES = ["streaming_llm", "h2o", "snapkv", "random", "knorm"]
LENGTHS = np.array([48, 29])


@pytest.fixture(scope="module")
def model():
    config = tiny_config(n_heads=4, n_kv_heads=2)
    return make_model(config, init_params(config, jax.random.key(0)))


@pytest.fixture(scope="module")
def tokens(model):
    return jax.random.randint(jax.random.key(1), (2, 48), 0, model.config.vocab_size)


def _prefill(m, tokens, max_len=64):
    out = forward(m, tokens, cache_states=m.init_cache(2, max_len), n_new=jnp.asarray(LENGTHS),
                  capture=True)
    return out


def _evicted(model, policy, ratio, **kw):
    return calibrate_and_apply(evict(policy, ratio, **kw), model, None)[0]


@pytest.mark.parametrize("policy", POLICIES)
def test_ratio_one_equals_dense_cache(model, tokens, policy):
    em = _evicted(model, policy, 1.0)
    dense, ev = _prefill(model, tokens), _prefill(em, tokens)
    np.testing.assert_array_equal(dense.logits, ev.logits)  # prefill is exact by design
    nxt = jax.random.randint(jax.random.key(2), (2, 6), 0, model.config.vocab_size)
    a = forward(model, nxt, cache_states=dense.cache_states, start=jnp.asarray(LENGTHS))
    b = forward(em, nxt, cache_states=ev.cache_states, start=jnp.asarray(LENGTHS))
    np.testing.assert_allclose(a.logits, b.logits, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.5])
def test_budget_is_ceil_ratio_per_row_and_head(model, tokens, policy, ratio):
    states = _prefill(_evicted(model, policy, ratio), tokens).cache_states
    for s in states:
        per_head = np.sum(np.asarray(s["pos"]) >= 0, axis=1)  # [B, Hkv]
        expect = np.ceil(ratio * LENGTHS).astype(int)
        np.testing.assert_array_equal(per_head, np.repeat(expect[:, None], 2, 1))
        np.testing.assert_array_equal(s["n"], expect)
        assert np.all(np.asarray(s["pos"]) < LENGTHS[:, None, None])  # no padding kept


def _kept_sets(state):
    pos = np.asarray(state["pos"])
    return [[set(pos[b, :, h][pos[b, :, h] >= 0].tolist()) for h in range(pos.shape[2])]
            for b in range(pos.shape[0])]


def test_streaming_llm_keeps_sinks_and_recent(model, tokens):
    states = _prefill(_evicted(model, "streaming_llm", 0.25, sinks=3), tokens).cache_states
    for b, n in enumerate(LENGTHS):
        budget = math.ceil(0.25 * n)
        expect = set(range(3)) | set(range(n - (budget - 3), n))
        assert all(s == expect for s in _kept_sets(states[1])[b])


def _np_softmax_causal(q, k, n):
    """Per-row reference attention probs [Hkv, G, n, n] of the first n tokens (layer input)."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    g = hq // hkv
    qg = q[:n].reshape(n, hkv, g, d).transpose(1, 2, 0, 3).astype(np.float64)
    kk = k[:n].transpose(1, 0, 2).astype(np.float64)
    s = np.einsum("kgtd,ksd->kgts", qg, kk) / np.sqrt(d)
    s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    return s / s.sum(-1, keepdims=True)


def _np_topk_sets(scores, budget):  # scores [n, Hkv]
    return [set(np.argsort(-scores[:, h], kind="stable")[:budget].tolist())
            for h in range(scores.shape[1])]


def _assert_topk(kept_sets, scores, budget, tol=1e-5):
    """Each head kept `budget` tokens and none left out scores higher (up to f32 ties)."""
    for h, kept in enumerate(kept_sets):
        assert len(kept) == budget
        out = sorted(set(range(scores.shape[0])) - kept)
        if out:
            assert scores[sorted(kept), h].min() >= scores[out, h].max() - tol


@pytest.mark.parametrize("layer", [0, 1])
def test_snapkv_and_h2o_match_numpy_reference(model, tokens, layer):
    dense = _prefill(model, tokens)
    window, kernel, ratio = 8, 5, 0.5
    snap = _prefill(_evicted(model, "snapkv", ratio, window=window, kernel=kernel), tokens)
    h2o = _prefill(_evicted(model, "h2o", ratio, recent_fraction=0.25), tokens)
    cap = dense.captures[layer]
    for b, n in enumerate(LENGTHS):
        budget = math.ceil(ratio * n)
        w = _np_softmax_causal(np.asarray(cap["q"][b]), np.asarray(cap["k"][b]), n)
        # SnapKV: votes of the last `window` queries, mean over the group, avg-pooled.
        votes = w[:, :, n - window:, :].sum(2).mean(1)  # [Hkv, n]
        padded = np.pad(votes, ((0, 0), (kernel // 2, kernel // 2)))
        pooled = np.stack([padded[:, i:i + kernel].mean(1) for i in range(n)], 1)
        pooled[:, n - window:] = 1e9 + np.arange(window)
        _assert_topk(_kept_sets(snap.cache_states[layer])[b], pooled.T, budget)
        # H2O: attention accumulated over all queries (mean over group) + recent quarter.
        acc = w.mean(1).sum(1)  # [Hkv, n]
        n_recent = int(budget * 0.25)
        acc[:, n - n_recent:] = 1e9 + np.arange(n_recent)
        _assert_topk(_kept_sets(h2o.cache_states[layer])[b], acc.T, budget)


def test_knorm_keeps_smallest_keys_and_random_differs_per_layer(model, tokens):
    dense = _prefill(model, tokens)
    kn = _prefill(_evicted(model, "knorm", 0.25), tokens).cache_states
    for layer in range(2):
        norms = np.linalg.norm(np.asarray(dense.captures[layer]["k"]), axis=-1)
        for b, n in enumerate(LENGTHS):
            _assert_topk(_kept_sets(kn[layer])[b], -norms[b, :n], math.ceil(0.25 * n))
    r1 = _prefill(_evicted(model, "random", 0.25, seed=3), tokens).cache_states
    r2 = _prefill(_evicted(model, "random", 0.25, seed=3), tokens).cache_states
    assert _kept_sets(r1[0]) == _kept_sets(r2[0])  # deterministic
    assert _kept_sets(r1[0]) != _kept_sets(r1[1])  # but not the same subset in every layer


def test_decode_attends_to_exactly_the_kept_tokens(model, tokens):
    """Layer-0 output of a new chunk equals core `attend` over the full K/V with evicted
    positions masked out, KV head by KV head."""
    em = _evicted(model, "snapkv", 0.25, window=4)
    dense, ev = _prefill(model, tokens), _prefill(em, tokens)
    nxt = jax.random.randint(jax.random.key(5), (2, 3), 0, model.config.vocab_size)
    start = jnp.asarray(LENGTHS)
    full = forward(model, nxt, cache_states=dense.cache_states, start=start, capture=True)
    got = forward(em, nxt, cache_states=ev.cache_states, start=start, capture=True)
    c = model.config
    g = c.n_heads // c.n_kv_heads
    q = full.captures[0]["q"]  # layer 0 queries do not depend on the cache
    kbuf, vbuf = full.cache_states[0]["k"], full.cache_states[0]["v"]
    kept = np.zeros(kbuf.shape[:3], bool)
    for b in range(2):
        for h, s in enumerate(_kept_sets(ev.cache_states[0])[b]):
            kept[b, list(s), h] = True
            kept[b, LENGTHS[b]:LENGTHS[b] + 3, h] = True  # the chunk itself
    q_pos = start[:, None] + jnp.arange(3)[None]
    kv_pos = jnp.broadcast_to(jnp.arange(kbuf.shape[1])[None], kbuf.shape[:2])
    outs = [attend(q[:, :, h * g:(h + 1) * g], kbuf[:, :, h:h + 1], vbuf[:, :, h:h + 1],
                   q_pos, kv_pos, jnp.asarray(kept[:, :, h])) for h in range(c.n_kv_heads)]
    expect = jnp.concatenate(outs, axis=2).reshape(2, 3, -1)
    np.testing.assert_allclose(got.captures[0]["attn"], expect, atol=1e-5, rtol=1e-5)


def test_trim_states_saves_memory_and_keeps_outputs(model, tokens):
    from research.kv.base import state_nbytes
    em = _evicted(model, "h2o", 0.25)
    ev = _prefill(em, tokens, max_len=128)
    trimmed = trim_states(ev.cache_states, room=4)
    assert trimmed[0]["k"].shape[1] == int(np.max(np.ceil(0.25 * LENGTHS))) + 4
    assert state_nbytes(trimmed) < state_nbytes(ev.cache_states) / 4
    nxt = jax.random.randint(jax.random.key(6), (2, 4), 0, model.config.vocab_size)
    start = jnp.asarray(LENGTHS)
    a = forward(em, nxt, cache_states=ev.cache_states, start=start).logits
    b = forward(em, nxt, cache_states=trimmed, start=start).logits
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(kept_tokens(trimmed[0]), np.ceil(0.25 * LENGTHS))


def test_generate_and_chain_with_dtype(model):
    em = calibrate_and_apply(chain(kv_cache_dtype("bfloat16"), evict("snapkv", 0.5)),
                             model, None)[0]
    assert all(isinstance(c, EvictingKVCache) and c.dtype == "bfloat16" for c in em.caches)
    out = generate(em, [list(range(1, 30)), [5, 6, 7]], max_new_tokens=6)
    assert [len(t) for t in out.tokens] == [6, 6]
    assert "evict" in em.caches[0].describe()


def test_window_layers_are_left_alone_and_layer_ratios():
    config = tiny_config(n_layers=3).with_interleaved_attention(window=8, globals_every=3)
    m = make_model(config, init_params(config, jax.random.key(0)))
    em = calibrate_and_apply(evict("knorm", 0.5, layer_ratios=(0.2, 0.3, 0.4)), m, None)[0]
    assert isinstance(em.caches[0], WindowKVCache)
    assert isinstance(em.caches[2], EvictingKVCache) and em.caches[2].ratio == 0.4
    ratios = eviction.pyramid_ratios(0.25, 6)
    assert ratios[0] > ratios[-1] and abs(np.mean(ratios) - 0.25) < 1e-9


class _OtherCache(KVCache):
    """A cache type eviction does not know how to wrap."""

    def init(self, batch, max_len, n_kv_heads, head_dim):
        return {}

    def update_and_attend(self, state, q, k, v, *, start, n_new, window):
        raise NotImplementedError

    def describe(self):
        return "other"


def test_bad_input(model):
    for ratio in (0.0, -0.1, 1.5, "half"):
        with pytest.raises(ValueError, match="ratio"):
            evict("snapkv", ratio)
    with pytest.raises(ValueError, match="policy must be one of"):
        evict("lru", 0.5)
    with pytest.raises(TypeError, match="bad options"):
        evict("snapkv", 0.5, sinks=4)
    with pytest.raises(ValueError, match="window"):
        evict("snapkv", 0.5, window=0)
    with pytest.raises(ValueError, match="kernel"):
        SnapKV(kernel=4)
    with pytest.raises(ValueError, match="sinks"):
        StreamingLLM(sinks=-1)
    with pytest.raises(ValueError, match="recent_fraction"):
        H2O(recent_fraction=2.0)
    with pytest.raises(TypeError, match="policy must be"):
        make_policy(object())
    with pytest.raises(ValueError, match="layer_ratios"):
        calibrate_and_apply(evict("knorm", 0.5, layer_ratios=(0.5,)), model, None)
    with pytest.raises(ValueError, match="dtype"):
        EvictingKVCache(policy=KeyNorm(), ratio=0.5, dtype="int8")
    odd = model.replace(caches=(model.caches[0], _OtherCache()))
    with pytest.raises(TypeError, match="layer 1"):
        calibrate_and_apply(evict("knorm", 0.5), odd, None)
    with pytest.raises(ValueError, match="room"):
        trim_states((), -1)
    assert isinstance(model.caches[0], DenseKVCache)
