"""Folding K/V scales into W_q/W_k/W_v/W_o leaves the model exactly unchanged (f32)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.model import forward
from research.tasq.fold import check_rope_pair_tied, fold_kv_scales


def _pair_tied_scales(rng, n_layers, hkv, d):
    half = rng.uniform(0.2, 5.0, size=(n_layers, hkv, d // 2))
    return np.concatenate([half, half], axis=-1).astype(np.float32)


def _scales(model, seed):
    rng = np.random.default_rng(seed)
    c = model.config
    ks = _pair_tied_scales(rng, c.n_layers, c.n_kv_heads, c.head_dim)
    vs = rng.uniform(0.2, 5.0, size=(c.n_layers, c.n_kv_heads, c.head_dim)).astype(np.float32)
    return ks, vs


def test_fold_is_exact_on_tiny_model_and_rescales_the_cache_inputs(tiny):
    ks, vs = _scales(tiny, 0)
    folded = fold_kv_scales(tiny, ks, vs)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 97, (2, 12)), jnp.int32)
    fwd = jax.jit(lambda m: forward(m, tokens, capture=True))
    a, b = fwd(tiny), fwd(folded)
    np.testing.assert_allclose(b.logits, a.logits, rtol=1e-5, atol=1e-5)
    # ... while the cache really sees scaled post-RoPE keys and values
    np.testing.assert_allclose(b.captures[1]["k"], a.captures[1]["k"] * ks[1], rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(b.captures[0]["v"], a.captures[0]["v"] * vs[0], rtol=1e-5,
                               atol=1e-5)
    # and through the KV cache (prefill + decode) as well
    st = tiny.init_cache(2, 16)
    st_f = folded.init_cache(2, 16)
    fwd_cached = jax.jit(lambda m, s: forward(m, tokens, cache_states=s, logits="last").logits)
    la, lb = fwd_cached(tiny, st), fwd_cached(folded, st_f)
    np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-5)


def test_fold_is_exact_on_smollm2(smollm2):
    """The real checkpoint (30 layers, GQA 3:1, head_dim 64) in f32, before quantisation."""
    model, tok = smollm2
    ks, vs = _scales(model, 2)
    folded = fold_kv_scales(model, ks, vs)
    tokens = jnp.asarray([tok.encode("The capital of France is Paris, and the capital")],
                         jnp.int32)
    fwd = jax.jit(lambda m: forward(m, tokens).logits)
    a, b = fwd(model), fwd(folded)
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=2e-4)
    assert int(jnp.argmax(a[0, -1])) == int(jnp.argmax(b[0, -1]))


def test_scales_must_respect_rope_pairs_and_be_positive(tiny):
    ks, vs = _scales(tiny, 3)
    bad = ks.copy()
    bad[0, 0, 0] *= 2.0  # channel 0 scaled differently from its RoPE partner D/2
    with pytest.raises(ValueError, match="RoPE pair"):
        fold_kv_scales(tiny, bad, vs)
    with pytest.raises(ValueError, match="value_scale"):
        fold_kv_scales(tiny, ks, -vs)
    with pytest.raises(ValueError, match="key_scale must have shape"):
        fold_kv_scales(tiny, ks[:1], vs)
    with pytest.raises(ValueError, match="RoPE"):
        check_rope_pair_tied(np.arange(8.0))
