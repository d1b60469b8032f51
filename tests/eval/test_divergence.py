"""KL / top-1 agreement of a model against a reference on windows' continuations: zero for
the same model, and equal to a direct float64 numpy computation from one full-window
forward per model (a lossy int8 KV cache against the exact model) on fresh random text."""
import jax.numpy as jnp
import numpy as np
import pytest

from research.eval.divergence import continuation_logits, divergence, divergences
from research.eval.perplexity import continuation_perplexity
from research.kv.dense import DenseKVCache
from research.kv.quantized import Int8Codec
from research.model import forward


def _int8(model):
    return model.replace(caches=(DenseKVCache(Int8Codec()),) * model.config.n_layers)


def _logp(model, wins):
    """float64 log-softmax of one forward over each whole window through its own cache."""
    states = model.init_cache(*wins.shape)
    logits = forward(model, jnp.asarray(wins), cache_states=states).logits
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_kl_and_agreement_equal_a_direct_computation(tiny):
    """int8 KV vs the exact model: per-window KL, top-1 and NLLs equal numpy's from one
    forward over each whole window; the model's perplexity equals continuation_perplexity;
    the context is prefilled in pieces smaller than it (and not dividing it); the
    reference against itself has KL 0 and top-1 agreement 1."""
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    n_context, length = 27, 45
    wins = rng.integers(0, tiny.config.vocab_size, (3, length))
    lossy = _int8(tiny)
    got = divergences(tiny, {"int8": lossy, "same": tiny}, wins, n_context, batch_size=2,
                      chunk=16)
    ref, mod = _logp(tiny, wins), _logp(lossy, wins)
    pos = slice(n_context - 1, length - 1)
    kl = (np.exp(ref) * (ref - mod))[:, pos].sum(-1)  # [n, positions]
    top1 = ref[:, pos].argmax(-1) == mod[:, pos].argmax(-1)
    tgt = wins[:, n_context:, None]
    nll = -np.take_along_axis(mod[:, pos], tgt, -1)[..., 0]
    ref_nll = -np.take_along_axis(ref[:, pos], tgt, -1)[..., 0]
    d = got["int8"]
    assert kl.mean() > 1e-7  # the int8 cache does move the distribution
    # KL ~1e-5 is a difference of nearly equal log-probs: chunked prefill's f32 logits
    # (pieces of 16) move it by ~1e-3 relative, so the bound is absolute at that scale
    np.testing.assert_allclose(d.window_kl, kl.mean(1), rtol=1e-2, atol=1e-7)
    assert d.kl == pytest.approx(kl.mean(), rel=1e-2, abs=1e-7)
    np.testing.assert_allclose(d.window_top1, top1.mean(1))
    np.testing.assert_allclose(d.window_nll, nll.mean(1), rtol=1e-5)
    np.testing.assert_allclose(d.window_ref_nll, ref_nll.mean(1), rtol=1e-5)
    assert d.ppl == pytest.approx(continuation_perplexity(lossy, wins, n_context,
                                                          chunk=16).ppl, rel=1e-5)
    same = got["same"]  # the reference itself: nothing moves
    assert same.kl == pytest.approx(0.0, abs=1e-7) and same.top1 == 1.0
    assert same.ppl == pytest.approx(same.ref_ppl) and same.ref_ppl == d.ref_ppl
    assert d.n_tokens == same.n_tokens == 3 * (length - n_context)
    logits = continuation_logits(tiny, wins, n_context, chunk=16)  # the scored rows
    assert logits.shape == (3, length - n_context, tiny.config.vocab_size)


def test_bad_arguments(tiny):
    wins = np.zeros((2, 16), np.int32)
    with pytest.raises(ValueError, match="n_context"):
        divergence(tiny, tiny, wins, 16)
    with pytest.raises(ValueError, match="n_context"):
        divergence(tiny, tiny, wins, 0)
    with pytest.raises(ValueError, match="windows"):
        divergence(tiny, tiny, wins[0], 4)
    with pytest.raises(ValueError, match="windows"):
        divergence(tiny, tiny, wins.astype(np.float32), 4)
    with pytest.raises(ValueError, match="models"):
        divergences(tiny, {}, wins, 4)
    with pytest.raises(ValueError, match="batch_size"):
        divergence(tiny, tiny, wins, 4, batch_size=0)
    with pytest.raises(ValueError, match="chunk"):
        divergence(tiny, tiny, wins, 4, chunk=0)
