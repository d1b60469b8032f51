"""The decoder on small random models: cache paths agree with cache-free attention."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.kv.dense import DenseKVCache
from research.model import MoEConfig, forward, init_params, make_model, tiny_config
from research.model import layers
from research.model.config import ModelConfig

ATOL = 2e-5
fwd = jax.jit(forward, static_argnames=("logits", "capture"))


def _tokens(key, b, t, vocab=97):
    return jax.random.randint(jax.random.key(key), (b, t), 0, vocab, jnp.int32)


def _model(**overrides):
    config = tiny_config(**overrides)
    return make_model(config, init_params(config, jax.random.key(7)))


def _incremental_logits(model, tokens, n_prefill):
    """Prefill n_prefill tokens, then decode the rest one at a time through the cache."""
    b, t = tokens.shape
    states = model.init_cache(b, t)
    out = fwd(model, tokens[:, :n_prefill], cache_states=states)
    logits, states = [out.logits], out.cache_states
    for i in range(n_prefill, t):
        out = fwd(model, tokens[:, i:i + 1], cache_states=states,
                      start=jnp.full((b,), i, jnp.int32))
        logits.append(out.logits)
        states = out.cache_states
    return jnp.concatenate(logits, axis=1)


@pytest.mark.parametrize("overrides", [
    {},
    {"n_kv_heads": 1},
    {"layer_kinds": ("sliding", "global"), "sliding_window": 3},
    {"moe": MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=16)},
], ids=["gqa", "mqa", "sliding", "moe"])
def test_incremental_decode_equals_full_forward(overrides):
    model = _model(**overrides)
    tokens = _tokens(1, 2, 11)
    full = fwd(model, tokens).logits
    np.testing.assert_allclose(_incremental_logits(model, tokens, 5), full, atol=ATOL)


def test_window_ring_equals_dense_cache_with_window_mask():
    model = _model(layer_kinds=("sliding", "sliding"), sliding_window=4)
    dense = model.replace(caches=(DenseKVCache(), DenseKVCache()))
    tokens = _tokens(2, 1, 13)
    np.testing.assert_allclose(_incremental_logits(model, tokens, 9),
                               _incremental_logits(dense, tokens, 9), atol=ATOL)


def test_padded_batch_equals_rows_alone():
    model = _model()
    a, b = _tokens(3, 1, 9)[0], _tokens(4, 1, 5)[0]
    tokens = jnp.stack([a, jnp.pad(b, (0, 4))])
    lengths = jnp.array([9, 5])
    out = fwd(model, tokens, cache_states=model.init_cache(2, 16), n_new=lengths,
                  logits="last")
    alone_a = fwd(model, a[None], logits="last").logits[0]
    alone_b = fwd(model, b[None], logits="last").logits[0]
    np.testing.assert_allclose(out.logits[0], alone_a, atol=ATOL)
    np.testing.assert_allclose(out.logits[1], alone_b, atol=ATOL)
    # padding was not written: a decode step for row 1 at position 5 sees only 5 tokens
    nxt = jnp.array([3, 3])
    dec = fwd(model, nxt[:, None], cache_states=out.cache_states, start=lengths,
                  logits="last")
    ref = fwd(model, jnp.concatenate([b, nxt[1:]])[None], logits="last").logits[0]
    np.testing.assert_allclose(dec.logits[1], ref, atol=ATOL)


def test_moe_ffn_matches_per_token_loop():
    config = tiny_config(moe=MoEConfig(n_experts=5, top_k=2, expert_ffn_dim=12))
    p = init_params(config, jax.random.key(3))["layers"][0]
    x = jax.random.normal(jax.random.key(4), (17, config.dim))
    y, routing = layers.moe_ffn(x, p, top_k=2, renormalize=True)
    # every token through every expert, then pick its top-k and weight them
    all_experts = jax.vmap(lambda g, u, d: layers.swiglu(x, g, u, d))(
        p["w_gate"], p["w_up"], p["w_down"])  # [E, N, D]
    picked = all_experts[routing.expert_ids, jnp.arange(x.shape[0])[:, None]]  # [N, K, D]
    ref = jnp.sum(picked * routing.weights[..., None], axis=1)
    np.testing.assert_allclose(y, ref, atol=1e-5)
    np.testing.assert_allclose(jnp.sum(routing.weights, -1), 1.0, atol=1e-6)


def test_rope_is_relative():
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 8))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 8))
    rot = lambda x, p: layers.apply_rope(x, jnp.array([[p]]), 10000.0)  # noqa: E731
    s1 = jnp.sum(rot(q, 7) * rot(k, 3))
    s2 = jnp.sum(rot(q, 104) * rot(k, 100))
    np.testing.assert_allclose(s1, s2, rtol=1e-5)
    np.testing.assert_allclose(jnp.linalg.norm(rot(q, 5)), jnp.linalg.norm(q), rtol=1e-6)


def test_bf16_close_to_f32():
    model = _model()
    tokens = _tokens(5, 2, 8)
    ref = fwd(model, tokens).logits
    got = fwd(model.astype(jnp.bfloat16), tokens).logits
    assert got.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(got - ref))) < 0.03 * float(jnp.max(jnp.abs(ref)))


def test_capture_shapes():
    model = _model()
    out = fwd(model, _tokens(6, 2, 5), capture=True)
    cap = out.captures[0]
    c = model.config
    assert cap["q"].shape == (2, 5, c.n_heads, c.head_dim)
    assert cap["k"].shape == cap["k_pre"].shape == (2, 5, c.n_kv_heads, c.head_dim)
    assert cap["attn"].shape == (2, 5, c.n_heads * c.head_dim)


def test_jit_is_deterministic():
    model = _model()
    tokens = _tokens(8, 2, 6)
    f = jax.jit(lambda m, t: forward(m, t).logits)
    np.testing.assert_array_equal(f(model, tokens), f(model, tokens))


def test_bad_inputs():
    model = _model()
    with pytest.raises(ValueError, match="tokens must be \\[batch, time\\]"):
        fwd(model, jnp.zeros((4,), jnp.int32))
    with pytest.raises(TypeError, match="integer token ids"):
        fwd(model, jnp.zeros((1, 4), jnp.float32))
    with pytest.raises(ValueError, match="logits must be"):
        fwd(model, jnp.zeros((1, 4), jnp.int32), logits="some")
    with pytest.raises(ValueError, match="batch and max_len"):
        model.init_cache(0, 8)


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_heads=3, n_kv_heads=2), "multiple of"),
    (dict(head_dim=7), "even"),
    (dict(layer_kinds=("global",)), "entries"),
    (dict(layer_kinds=("sliding", "global")), "sliding_window"),
    (dict(layer_kinds=("local", "global"), sliding_window=2), "layer_kinds entries"),
    (dict(dim=0), "dim must be"),
])
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**kwargs)


def test_bad_moe_config():
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(n_experts=2, top_k=3, expert_ffn_dim=4)
    with pytest.raises(ValueError, match="moe_layers"):
        ModelConfig(vocab_size=8, dim=8, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8,
                    ffn_dim=8, moe_layers=(0,))


def test_interleaved_attention_config():
    c = tiny_config(n_layers=8).with_interleaved_attention(window=16, globals_every=4)
    assert c.layer_kinds == ("sliding",) * 3 + ("global",) + ("sliding",) * 3 + ("global",)
    assert c.window(0) == 16 and c.window(3) is None


def test_decoder_block_and_feed_forward_rebuild_forward():
    """The public per-layer hooks, chained by hand, are `forward` (MoE layer included)."""
    from research.model.llama import decoder_block, feed_forward, unembed
    model = _model(moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=16), moe_layers=(1,))
    tokens = _tokens(3, 2, 7)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    valid = jnp.ones((b, t), bool)
    x = model.params["embed"][tokens]
    for layer in range(model.config.n_layers):
        out = decoder_block(model, layer, x, positions, valid, None, None, None, capture=True)
        p = model.params["layers"][layer]
        mid = x + out.captured["attn"] @ p["wo"]
        ffn, routing = feed_forward(model.config, layer, p,
                                    layers.rms_norm(mid, p["ffn_norm"], model.config.norm_eps))
        np.testing.assert_allclose(mid + ffn, out.x, atol=ATOL)
        assert (routing is None) == (layer == 0)
        x = out.x
    np.testing.assert_allclose(unembed(model, x), forward(model, tokens).logits, atol=ATOL)


@pytest.mark.parametrize("weight, layer, expected", [
    (None, 0, -1), ("wk", 1, 1), ("wv", 0, 0), ("w_down", 0, 0)])
def test_check_finite_names_the_first_nonfinite_layer(weight, layer, expected):
    model = _model()
    if weight is not None:
        params = jax.tree.map(lambda a: a, model.params)
        lp = dict(params["layers"][layer])
        lp[weight] = lp[weight].at[0, 0].set(jnp.nan)
        params["layers"] = tuple(lp if i == layer else q
                                 for i, q in enumerate(params["layers"]))
        model = model.replace(params=params)
    tokens = _tokens(4, 2, 6)
    # row 1 is one token long: its padding never counts (the NaN is at token 0 either way)
    out = forward(model, tokens, cache_states=model.init_cache(2, 8),
                  n_new=jnp.array([6, 1], jnp.int32), check_finite=True)
    np.testing.assert_array_equal(out.nonfinite_layer, [expected, expected])
    assert forward(model, tokens).nonfinite_layer is None


def test_check_finite_ignores_padding():
    model = _model()
    model = model.replace(params={**model.params,
                                  "embed": model.params["embed"].at[0].set(jnp.nan)})
    tokens = jnp.array([[5, 6, 7, 0], [8, 9, 0, 0]], jnp.int32)  # id 0 only as padding
    out = forward(model, tokens, cache_states=model.init_cache(2, 8),
                  n_new=jnp.array([3, 2], jnp.int32), check_finite=True, logits="last")
    np.testing.assert_array_equal(out.nonfinite_layer, [-1, -1])
    # the tied LM head still scores token 0 with its NaN embedding: only that column
    assert np.isfinite(out.logits[:, 1:]).all() and np.isnan(out.logits[:, 0]).all()
    real = forward(model, tokens, cache_states=model.init_cache(2, 8), check_finite=True)
    np.testing.assert_array_equal(real.nonfinite_layer, [0, 0])
