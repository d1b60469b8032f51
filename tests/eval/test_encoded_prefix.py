"""research/eval/encoded_prefix.py: an exact prefix written into a cache, then read, gives
the logits of one full forward (f32 cache); a lossy cache holds what its own prefill writes
at the first layer; greedy tokens follow the full forward's argmax; a codec model whose
residual stream differs is refused. Fresh random tokens every run."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.eval import encoded_prefix as E
from research.kv.dense import DenseKVCache
from research.kv.quantized import Int8Codec
from research.model import forward
from research.serving import kv_codecs


def _rng():
    return np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))


def _f32(model):
    return kv_codecs.codec_model(model, "f32")


def test_prefix_then_read_equals_one_forward(tiny):
    """Blocks of 16 queries over a 45-token prefix (not a multiple), then 19 tokens read
    through the f32 cache: the logits of one cache-free forward over all 64 tokens."""
    rng = _rng()
    tokens = rng.integers(0, tiny.config.vocab_size, (2, 64)).astype(np.int32)
    prefix = E.exact_prefix(tiny, tokens[:, :45], block=16)
    assert len(prefix.inputs) == tiny.config.n_layers
    m = _f32(tiny)
    states = E.encoded_states(m, prefix, 64)
    got, _ = E.run_tokens(m, states, tokens[:, 45:], 45)
    want = forward(tiny, jnp.asarray(tokens)).logits[:, 45:]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_lossy_cache_holds_what_its_prefill_writes(tiny):
    """Layer 0 sees the same input either way, so its int8 records equal those a chunked
    prefill through the int8 cache writes (later layers differ: serving reads int8)."""
    rng = _rng()
    tokens = rng.integers(0, tiny.config.vocab_size, (1, 40)).astype(np.int32)
    lossy = tiny.replace(caches=(DenseKVCache(Int8Codec()),) * tiny.config.n_layers)
    states = E.encoded_states(lossy, E.exact_prefix(tiny, tokens), 48)
    served = forward(lossy, jnp.asarray(tokens), cache_states=lossy.init_cache(1, 48),
                     logits="none").cache_states
    for name, x in states[0].items():
        np.testing.assert_array_equal(np.asarray(x), np.asarray(served[0][name]), name)


def test_greedy_tokens_follow_the_full_forward(tiny):
    rng = _rng()
    tokens = rng.integers(0, tiny.config.vocab_size, (1, 30)).astype(np.int32)
    m = _f32(tiny)
    states = E.encoded_states(m, E.exact_prefix(tiny, tokens[:, :24]), 40)
    got = E.greedy_tokens(m, states, tokens[:, 24:], 24, 5)
    seq = tokens
    for _ in range(5):
        nxt = jnp.argmax(forward(tiny, jnp.asarray(seq)).logits[:, -1], -1)
        seq = np.concatenate([seq, np.asarray(nxt)[:, None]], axis=1)
    np.testing.assert_array_equal(got, seq[:, 30:])
    with pytest.raises(ValueError, match="max_new_tokens"):
        E.greedy_tokens(m, states, tokens[:, 24:], 24, 0)


def test_bad_inputs_are_refused(tiny):
    tokens = np.zeros((1, 8), np.int32)
    with pytest.raises(ValueError, match="tokens"):
        E.exact_prefix(tiny, tokens[0])
    with pytest.raises(ValueError, match="block"):
        E.exact_prefix(tiny, tokens, block=0)
    prefix = E.exact_prefix(tiny, tokens)
    with pytest.raises(ValueError, match="max_len"):
        E.encoded_states(tiny, prefix, 8)
    layers = list(tiny.params["layers"])
    layers[1] = {**layers[1], "w_up": layers[1]["w_up"] * 2}
    other = tiny.replace(params={**tiny.params, "layers": tuple(layers)})
    with pytest.raises(ValueError, match=r"layers\[1\].w_up"):
        E.encoded_states(other, prefix, 16)
    wk = list(tiny.params["layers"])  # only the attention projections differ: accepted
    wk[0] = {**wk[0], "wk": wk[0]["wk"] * 2}
    E.encoded_states(tiny.replace(params={**tiny.params, "layers": tuple(wk)}), prefix, 16)


def test_blocked_exact_attention_equals_the_reference():
    """ExactChunkCache's blocked causal attention equals one masked attention."""
    from research.core import attention
    ks = jax.random.split(jax.random.key(_rng().integers(2**31)), 3)
    q = jax.random.normal(ks[0], (2, 37, 4, 8))
    k, v = (jax.random.normal(x, (2, 37, 2, 8)) for x in ks[1:])
    out, _ = E.ExactChunkCache(block=10).update_and_attend(
        {}, q, k, v, start=jnp.zeros(2, jnp.int32), n_new=jnp.full(2, 37), window=None)
    pos = jnp.broadcast_to(jnp.arange(37), (2, 37))
    want = attention.attend(q, k, v, pos, pos, jnp.ones((2, 37), bool))
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
