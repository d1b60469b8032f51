"""Drafters: n-gram lookup, layer-subset (self-speculative) network, draft-model sync."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.model import MoEConfig, forward, init_params, make_model, tiny_config
from research.decode.sampling import SamplingConfig
from research.specdecode import (DraftContext, early_exit, layer_subset_model, model_drafter,
                                 prompt_lookup, self_speculative)
from research.specdecode.drafters import lookup_continuation, ngram_match

# jitted entry points: eager op-by-op dispatch of a forward is much slower than a compile
_logits = jax.jit(lambda model, tokens: forward(model, tokens).logits)
_prefill = jax.jit(lambda model, tokens, states: forward(model, tokens,
                                                         cache_states=states).cache_states)


def _propose(drafter, *args):
    return jax.jit(drafter.propose, static_argnums=(4, 5))(*args)


def _ctx(rows, width=24):
    hist = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        hist[i, :len(r)] = r
    return DraftContext(jnp.asarray(hist), jnp.asarray([len(r) for r in rows], jnp.int32),
                        jnp.ones((len(rows),), bool))


def test_ngram_match_finds_latest_earlier_occurrence():
    ctx = _ctx([[1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3],  # two earlier matches: take the later
                [4, 5, 6, 7],  # suffix never occurred before
                [5, 5, 5, 5]])  # overlapping self-match: continuation is still known
    found, cont = ngram_match(ctx.history, ctx.n_history, 3)
    assert found.tolist() == [True, False, True]
    assert int(cont[0]) == 7  # history[4:7] == [1, 2, 3]; the draft starts at token 8
    assert int(cont[2]) == 3


def test_lookup_prefers_longer_ngrams_and_clips_to_known_tokens():
    # 1-gram [3] last occurred at 5 (-> 4); the 2-gram [2, 3] at 1..2 (-> 7, 3)
    ctx = _ctx([[1, 2, 3, 7, 3, 3, 4, 2, 3]])
    n_avail, cont, which = lookup_continuation(ctx.history, ctx.n_history, (2, 1))
    assert int(cont[0]) == 3 and int(n_avail[0]) == 6 and int(which[0]) == 0
    n_avail, cont, which = lookup_continuation(ctx.history, ctx.n_history, (3, 1))
    assert int(cont[0]) == 6 and int(n_avail[0]) == 3 and int(which[0]) == 1


def test_prompt_lookup_propose_is_deterministic_copy():
    d = prompt_lookup(max_ngram=2, min_ngram=1)
    assert d is prompt_lookup(max_ngram=2, min_ngram=1)  # cached: no re-jit per call
    ctx = _ctx([[10, 11, 12, 13, 14, 10, 11], [1, 2, 3]])
    ctx = ctx._replace(active=jnp.array([True, True]))
    avail = d.available((), ctx, 8)
    assert avail.n.tolist() == [5, 0] and avail.bucket.tolist()[0] == 0  # a 2-gram match
    draft, _, _ = d.propose((), None, (), ctx, 3, SamplingConfig(), jax.random.key(0))
    assert draft.probs is None
    assert draft.n.tolist() == [3, 0]
    assert draft.tokens.tolist() == [[12, 13, 14], [0, 0, 0]]
    inactive = ctx._replace(active=jnp.array([False, True]))
    assert d.available((), inactive, 8).n.tolist() == [0, 0]


@pytest.mark.parametrize("bad", [dict(max_ngram=0, min_ngram=0), dict(max_ngram=1,
                                                                       min_ngram=2)])
def test_prompt_lookup_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="ngram"):
        prompt_lookup(**bad)


def test_layer_subset_model(tiny):
    tokens = jax.random.randint(jax.random.key(0), (2, 7), 0, 97)
    full = _logits(tiny, tokens)
    same = _logits(layer_subset_model(tiny, (0, 1)), tokens)
    np.testing.assert_allclose(same, full, rtol=1e-6, atol=1e-6)
    # early exit after layer 0 == a 1-layer model holding layer 0 and the shared head
    one = make_model(tiny_config(n_layers=1), {**tiny.params, "layers": tiny.params["layers"][:1]})
    np.testing.assert_allclose(_logits(layer_subset_model(tiny, (0,)), tokens),
                               _logits(one, tokens), rtol=1e-6, atol=1e-6)
    for bad in [(), (2,), (1, 0), (0, 0)]:
        with pytest.raises(ValueError, match="layers"):
            layer_subset_model(tiny, bad)


def test_layer_subset_keeps_moe_and_window_kinds():
    config = tiny_config(n_layers=4, moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=16),
                         moe_layers=(1, 3)).with_interleaved_attention(window=4,
                                                                      globals_every=2)
    model = make_model(config, init_params(config, jax.random.key(0)))
    sub = layer_subset_model(model, (0, 1, 3))
    assert sub.config.moe_layers == (1, 2)
    assert sub.config.layer_kinds == tuple(config.layer_kinds[i] for i in (0, 1, 3))
    dense_only = layer_subset_model(model, (0, 2))
    assert dense_only.config.moe is None and dense_only.config.moe_layers is None
    assert _logits(sub, jnp.zeros((1, 5), jnp.int32)).shape == (1, 5, 97)


def test_self_speculative_drafts_what_its_subnetwork_predicts(tiny):
    """The drafted tokens are the sub-network's greedy continuation, and the shared cache
    is written only at positions >= the pending token."""
    d = early_exit(1)
    prompt = jnp.asarray([[5, 6, 7, 8, 9]], jnp.int32)
    states = _prefill(tiny, prompt[:, :4], tiny.init_cache(1, 16))
    ctx = _ctx([[5, 6, 7, 8, 9]], width=16)
    draft, _, new_states = _propose(d, (), tiny, states, ctx, 3, SamplingConfig(),
                                    jax.random.key(0))
    sub = layer_subset_model(tiny, (0,))
    seq = [5, 6, 7, 8, 9, 0, 0, 0]
    for i in range(3):  # reference: cache-free greedy decoding of the 1-layer network
        seq[5 + i] = int(jnp.argmax(_logits(sub, jnp.asarray([seq]))[0, 4 + i]))
    assert draft.tokens[0].tolist() == seq[5:]
    assert draft.n.tolist() == [3]
    for old, new in zip(states, new_states):
        np.testing.assert_array_equal(old["k"][:, :4], new["k"][:, :4])


def test_self_speculative_sampling_returns_probs_and_confidence_cut(tiny):
    ctx = _ctx([[5, 6, 7, 8, 9]], width=16)
    states = _prefill(tiny, jnp.asarray([[5, 6, 7, 8]]), tiny.init_cache(1, 16))
    sampled, _, _ = _propose(self_speculative((0,)), (), tiny, states, ctx, 2,
                             SamplingConfig(temperature=1.0), jax.random.key(0))
    assert sampled.probs.shape == (1, 2, 97)
    np.testing.assert_allclose(sampled.probs.sum(-1), 1.0, rtol=1e-5)
    # a random tiny model is never 99% sure: drafting stops before the first token
    cut, _, _ = _propose(early_exit(1, min_confidence=0.99), (), tiny, states, ctx, 2,
                         SamplingConfig(), jax.random.key(0))
    assert cut.n.tolist() == [0]
    with pytest.raises(ValueError, match="min_confidence"):
        early_exit(1, min_confidence=1.0)


def test_model_drafter_keeps_its_cache_in_sync(tiny):
    """After observe/propose steps the draft model's cache equals a fresh prefill."""
    small_cfg = tiny_config(n_layers=1)
    small = make_model(small_cfg, init_params(small_cfg, jax.random.key(3)))
    d = model_drafter(small)
    seq = [3, 1, 4, 1, 5, 9]
    state = d.init(tiny, 1, 32, 2)
    state = jax.jit(d.prefill)(state, tiny, jnp.asarray([seq[:4]]), jnp.asarray([4]))
    propose = jax.jit(d.propose, static_argnums=(4, 5))
    observe = jax.jit(d.observe)
    # history grows 4 -> 5 (a step without drafting) -> 6 (1 draft rejected) -> 9 (2
    # drafts accepted + bonus token) -> 10 (0 accepted) -> 11 (k = 0 again)
    state = observe(state, tiny, (), _ctx([seq[:5]], 32))
    draft, state, _ = propose(state, tiny, (), _ctx([seq[:5]], 32), 2, SamplingConfig(),
                              jax.random.key(0))
    draft, state, _ = propose(state, tiny, (), _ctx([seq[:6]], 32), 2, SamplingConfig(),
                              jax.random.key(0))
    seq = seq + draft.tokens[0].tolist() + [7]
    draft, state, _ = propose(state, tiny, (), _ctx([seq], 32), 2, SamplingConfig(),
                              jax.random.key(0))
    seq = seq + [8]
    state = observe(state, tiny, (), _ctx([seq], 32))
    seq = seq + [2]
    draft, state, _ = propose(state, tiny, (), _ctx([seq], 32), 2, SamplingConfig(),
                              jax.random.key(0))
    n = len(seq)  # the draft cache must hold exactly the committed history (pending incl.)
    ref = _prefill(small, jnp.asarray([seq]), small.init_cache(1, 32))
    np.testing.assert_allclose(state["caches"][0]["k"][:, :n], ref[0]["k"][:, :n],
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="vocab"):
        model_drafter(make_model(tiny_config(vocab_size=50),
                                 init_params(tiny_config(vocab_size=50), jax.random.key(0)))
                      ).init(tiny, 1, 8, 2)
