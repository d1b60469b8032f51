"""Generation: greedy equals an argmax loop, stop tokens, sampling filters, errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.model import forward
from research.decode.generate import generate, pad_prompts
from research.decode.sampling import SamplingConfig, filter_logits, sample, token_probs


def _greedy_reference(model, prompt, n):
    """Re-run the whole sequence without a cache for every new token."""
    ids = list(prompt)
    f = jax.jit(lambda m, t, n: forward(m, t, n_new=n, logits="last").logits)
    for _ in range(n):
        padded = jnp.asarray([ids + [0] * (16 - len(ids))])  # one shape: one compile
        ids.append(int(jnp.argmax(f(model, padded, jnp.array([len(ids)]))[0])))
    return ids[len(prompt):]


def test_greedy_matches_uncached_argmax_loop(tiny):
    prompts = [[5, 9, 13, 2, 40, 7, 1], [3, 3]]
    gen = generate(tiny, prompts, max_new_tokens=6)
    for p, out in zip(prompts, gen.tokens):
        assert out == _greedy_reference(tiny, p, 6)
    assert gen.finish_reasons == ["length", "length"]
    assert gen.prompt_lengths == [7, 2]


def test_stop_token_ends_row_only(tiny):
    prompts = [[5, 9, 13], [3, 3]]
    free = generate(tiny, prompts, max_new_tokens=6).tokens
    stop = free[0][2]
    gen = generate(tiny, prompts, max_new_tokens=6, stop_tokens=[stop])
    assert gen.tokens[0] == free[0][:free[0].index(stop)]
    assert gen.finish_reasons[0] == "stop"
    if stop not in free[1]:
        assert gen.tokens[1] == free[1]


def test_sampling_is_reproducible_and_key_dependent(tiny):
    cfg = SamplingConfig(temperature=1.0, top_k=20, top_p=0.9)
    run = lambda k: generate(tiny, [[1, 2, 3]] * 2, max_new_tokens=8, sampling=cfg,  # noqa
                             key=jax.random.key(k)).tokens
    assert run(0) == run(0)
    assert run(0) != run(1)


def test_filter_logits_top_k_and_top_p():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept = lambda cfg: np.isfinite(np.asarray(filter_logits(logits, cfg)))[0]  # noqa
    assert kept(SamplingConfig(1.0, top_k=2)).tolist() == [1, 1, 0, 0, 0]
    assert kept(SamplingConfig(1.0, top_p=0.6)).tolist() == [1, 1, 0, 0, 0]
    assert kept(SamplingConfig(1.0, top_p=0.5)).tolist() == [1, 0, 0, 0, 0]
    assert kept(SamplingConfig(1.0, top_p=0.86)).tolist() == [1, 1, 1, 1, 0]
    probs = token_probs(logits, SamplingConfig(1.0, top_k=3))
    np.testing.assert_allclose(probs[0, :3], np.array([0.5, 0.2, 0.15]) / 0.85, rtol=1e-5)


def test_sample_frequencies_follow_filtered_distribution():
    logits = jnp.log(jnp.array([[0.4, 0.3, 0.2, 0.1]] * 4000))
    cfg = SamplingConfig(temperature=1.0, top_k=3)
    draws = np.asarray(sample(logits, jax.random.key(0), cfg))
    freq = np.bincount(draws, minlength=4) / draws.size
    np.testing.assert_allclose(freq, [4 / 9, 3 / 9, 2 / 9, 0], atol=0.03)


def test_prompt_longer_than_cache_is_an_error(tiny):
    with pytest.raises(ValueError, match="exceeds the cache max_len=8"):
        generate(tiny, [[1] * 6], max_new_tokens=4, max_len=8)


@pytest.mark.parametrize("prompts, err, match", [
    ([], ValueError, "prompts is empty"),
    ([[]], ValueError, "prompt 0 is empty"),
    ([[1, 500]], ValueError, "outside \\[0, 97\\)"),
    ([[1.5, 2.0]], TypeError, "integer token ids"),
])
def test_bad_prompts(prompts, err, match):
    with pytest.raises(err, match=match):
        pad_prompts(prompts, vocab_size=97)


def test_bad_sampling_args(tiny):
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0)
    with pytest.raises(ValueError, match="explicit PRNG"):
        generate(tiny, [[1]], max_new_tokens=2, sampling=SamplingConfig(temperature=1.0))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tiny, [[1]], max_new_tokens=0)


def test_real_model_answers(smollm2):
    from research.decode.generate import generate_text
    model, tok = smollm2
    out = generate_text(model, tok, ["What is the capital of France?"], max_new_tokens=12)
    assert "Paris" in out[0]


def _poisoned(model, **where):
    """A copy of `model` with params[...] NaN: where = {"layer": l, "name": "wk"} or
    {"name": "final_norm"} or {"name": "embed", "row": id}."""
    params = dict(model.params)
    name = where["name"]
    if "layer" in where:
        layer = dict(params["layers"][where["layer"]])
        layer[name] = layer[name].at[0].set(jnp.nan)
        params["layers"] = tuple(layer if i == where["layer"] else p
                                 for i, p in enumerate(params["layers"]))
    else:
        params[name] = params[name].at[where.get("row", 0)].set(jnp.nan)
    return model.replace(params=params)


@pytest.mark.parametrize("layer", [0, 1])
def test_nan_weights_in_a_layer_are_an_error_naming_it(tiny, layer):
    with pytest.raises(ValueError, match=rf"layer {layer} .*prefill"):
        generate(_poisoned(tiny, layer=layer, name="wk"), [[5, 9, 13], [3, 3]],
                 max_new_tokens=4)


def test_nan_first_met_while_decoding_names_the_step_and_layer():
    from research.model import init_params, make_model, tiny_config
    config = tiny_config(tie_embeddings=False)
    model = make_model(config, init_params(config, jax.random.key(0)))
    first = generate(model, [[5, 9, 13]], max_new_tokens=3).tokens[0]
    bad = _poisoned(model, name="embed", row=first[0])  # the first generated token's input
    with pytest.raises(ValueError, match=r"layer 0 .*decode step 1, row 0"):
        generate(bad, [[5, 9, 13]], max_new_tokens=3)


def test_nan_logits_with_finite_layers_blame_the_head(tiny):
    with pytest.raises(ValueError, match="final norm and the LM head"):
        generate(_poisoned(tiny, name="final_norm"), [[5, 9, 13]], max_new_tokens=3)


def test_chunked_prefill_equals_one_shot_prefill():
    """Pieces of 16 tokens (rows ending in different pieces, one shorter than a piece):
    the same last-token logits and the same cache as one prefill of the whole prompts."""
    from research.model import init_params, make_model, tiny_config
    from research.decode.generate import _prefill_checked, pad_prompts, prefill_in_chunks
    config = tiny_config(vocab_size=64, max_position=128, head_dim=16, n_heads=4,
                         n_kv_heads=2)
    model = make_model(config, init_params(config, jax.random.key(11)))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 64, n).tolist() for n in (45, 9, 33, 16)]
    tokens, lengths = pad_prompts(prompts, 64)
    want_logits, want_states, _ = _prefill_checked(
        model, jnp.asarray(tokens), jnp.asarray(lengths), model.init_cache(4, 64))
    logits, states, bad = prefill_in_chunks(model, tokens, lengths,
                                            model.init_cache(4, 64), chunk=16)
    np.testing.assert_allclose(logits, want_logits, atol=2e-5, rtol=2e-5)
    for got, want in zip(jax.tree.leaves(states), jax.tree.leaves(want_states)):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    assert (np.asarray(bad) == -1).all()
    with pytest.raises(ValueError, match="chunk"):
        prefill_in_chunks(model, tokens, lengths, model.init_cache(4, 64), chunk=0)


@pytest.mark.parametrize("codec", ["bfloat16", pytest.param("int8", marks=pytest.mark.slow)])
def test_chunked_prefill_skips_masked_key_blocks(codec):
    """Pieces attend over the live slots only (a power-of-two bucket of pieces): the
    result equals one prefill of the whole prompts for a float and an int8 cache, and an
    early piece's compiled program does a fraction of the full-capacity piece's FLOPs."""
    from research.kv.dense import DenseKVCache
    from research.kv.codec import FloatCodec
    from research.kv.quantized import Int8Codec
    from research.model import init_params, make_model, tiny_config
    from research.decode import generate as G
    config = tiny_config(vocab_size=64, max_position=256, head_dim=16, n_heads=4,
                         n_kv_heads=2)
    model = make_model(config, init_params(config, jax.random.key(3)))
    layout = DenseKVCache(codec=FloatCodec(codec) if codec != "int8" else Int8Codec())
    model = model.replace(caches=(layout,) * config.n_layers)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 64, n).tolist() for n in (100, 40, 128)]
    tokens, lengths = pad_prompts(prompts, 128)
    states = model.init_cache(3, 256)
    assert [model.live_slots(states, end, 32) for end in (32, 64, 96, 128, 256)] == \
        [32, 64, 128, 128, None]
    want_logits, want_states, _ = G._prefill_checked(
        model, jnp.asarray(tokens), jnp.asarray(lengths), model.init_cache(3, 256))
    logits, got_states, bad = G.prefill_in_chunks(model, tokens, lengths, states, chunk=32)
    np.testing.assert_allclose(logits, want_logits, atol=1e-3, rtol=1e-3)
    for got, want in zip(jax.tree.leaves(got_states), jax.tree.leaves(want_states)):
        # K/V of a piece vs of the whole prompt may round one storage ulp apart
        ulp = 1.0 if np.issubdtype(np.asarray(got).dtype, np.integer) else 8e-3
        np.testing.assert_allclose(np.asarray(got, np.float32),
                                   np.asarray(want, np.float32), atol=ulp, rtol=ulp)
    assert (np.asarray(bad) == -1).all()
    args = (model, jnp.zeros((3, 32), jnp.int32), jnp.zeros((3,), jnp.int32),
            jnp.full((3,), 32, jnp.int32), states)

    def flops(fn, **kw):
        cost = fn.lower(*args, **kw).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]
    assert flops(G.prefill_piece, live=32) < 0.8 * flops(G.prefill_piece)
