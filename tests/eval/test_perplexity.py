"""Sliding-window perplexity: coverage of the windows and agreement with a direct sum."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.eval.perplexity import perplexity, windows
from research.model import forward


@pytest.mark.parametrize("n, window, stride", [(100, 16, 8), (17, 16, 15), (5, 16, 4),
                                               (64, 8, 3)])
def test_every_target_scored_exactly_once(n, window, stride):
    scored = []
    for w in windows(n, window, stride):
        scored += list(range(w.end - w.n_scored, w.end))
        assert w.end - w.begin <= window and w.n_scored <= w.end - w.begin - 1 or w.begin == 0
    assert sorted(scored) == list(range(1, n))


def test_single_window_equals_direct_nll(tiny):
    ids = np.random.default_rng(0).integers(0, 97, 30)
    logits = jax.jit(forward)(tiny, jnp.asarray(ids)[None]).logits[0, :-1]
    nll = -jax.nn.log_softmax(logits)[jnp.arange(29), ids[1:]]
    got = perplexity(tiny, ids, window=32, batch_size=2)
    assert got.n_tokens == 29
    np.testing.assert_allclose(got.nll, float(jnp.mean(nll)), rtol=1e-5)


def test_strided_windows_see_limited_context(tiny):
    ids = np.random.default_rng(1).integers(0, 97, 40)
    full = perplexity(tiny, ids, window=40)
    strided = perplexity(tiny, ids, window=8, stride=4, batch_size=3)
    assert strided.n_tokens == full.n_tokens == 39
    assert strided.ppl != full.ppl  # less context changes the numbers


def test_bad_args(tiny):
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(tiny, [1], window=8)
    with pytest.raises(ValueError, match="stride"):
        perplexity(tiny, list(range(20)), window=8, stride=8)
    with pytest.raises(ValueError, match="window"):
        perplexity(tiny, list(range(20)), window=1)


@pytest.mark.parametrize("codec", ["float32", "int8"])
def test_chunked_scoring_equals_one_forward_per_window(tiny, codec):
    """Windows scored in pieces of `chunk` (ragged last piece, chunk not dividing the
    window) give the one-forward NLL: each piece reads what earlier pieces wrote."""
    from research.kv.dense import DenseKVCache
    from research.kv.quantized import Int8Codec
    if codec == "int8":
        tiny = tiny.replace(caches=(DenseKVCache(Int8Codec()),) * tiny.config.n_layers)
    ids = np.random.default_rng(3).integers(0, tiny.config.vocab_size, 150)
    kw = dict(window=64, stride=40, batch_size=2)
    whole = perplexity(tiny, ids, chunk=64, **kw)
    pieces = perplexity(tiny, ids, chunk=24, **kw)
    assert pieces.n_tokens == whole.n_tokens == 149
    assert pieces.nll == pytest.approx(whole.nll, rel=1e-5)
    with pytest.raises(ValueError, match="chunk"):
        perplexity(tiny, ids, chunk=0, **kw)


def test_continuation_perplexity_scores_the_tail_given_the_context(tiny):
    """Equals the NLL of the last L - n_context tokens from one plain forward per window,
    with the context prefilled in pieces smaller than it."""
    from research.eval.perplexity import continuation_perplexity
    rng = np.random.default_rng(5)
    wins = rng.integers(0, tiny.config.vocab_size, (3, 40))
    got = continuation_perplexity(tiny, wins, 24, batch_size=2, chunk=16)
    logits = forward(tiny, jnp.asarray(wins)).logits
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -np.take_along_axis(np.asarray(logp), wins[:, 1:, None], axis=-1)[..., 0]
    assert got.n_tokens == 3 * 16
    np.testing.assert_allclose(got.nll, nll[:, 23:].mean(), rtol=1e-5)
    with pytest.raises(ValueError, match="n_context"):
        continuation_perplexity(tiny, wins, 40)
