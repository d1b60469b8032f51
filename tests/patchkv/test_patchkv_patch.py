"""PatchKV transform on a tiny random model: zero patch without compression, no change under
huge regularisation, gains on held-out queries, composition with every eviction policy and
with a quantized cache, zero per-query overhead, and bad input."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.kv.base import KVCache, scatter_tokens, write_positions
from research.kv.dense import DenseKVCache
from research.eviction.press import evict
from research.model import forward, init_params, make_model, tiny_config
from research.core.attention import attend
from research.patchkv import baselines, patch, session
from research.patchkv.probes import ProbeConfig, probe_context
from research.patchkv.ridge import RidgeConfig
from flax import struct
from research.transforms import CalibrationData, Transform, calibrate_and_apply, chain

PROBES = ProbeConfig(n_generated=4, n_repeat=4, length=16, seed=0)
N_CTX = 96


@pytest.fixture(scope="module")
def model():
    config = tiny_config(vocab_size=97, dim=48, n_heads=4, n_kv_heads=2, head_dim=12,
                         ffn_dim=96)
    return make_model(config, init_params(config, jax.random.key(0)))


@pytest.fixture(scope="module")
def context(model):
    ids = jax.random.randint(jax.random.key(3), (N_CTX,), 0, model.config.vocab_size)
    return np.asarray(ids, np.int32)


@pytest.fixture(scope="module")
def queries(model):  # evaluation rows never used for fitting
    return np.asarray(jax.random.randint(jax.random.key(9), (4, 12), 0,
                                         model.config.vocab_size), np.int32)


def _data(context):
    return CalibrationData(jnp.asarray(context[None]), jnp.asarray([len(context)]))


@pytest.fixture(scope="module")
def probed(model, context):  # the compression-independent half of a fit, shared
    return probe_context(model, _data(context), PROBES)


def _attention_error(model, compressed, patched, context, queries):
    """(unpatched, patched) attention-output error on evaluation queries vs full cache."""
    ref = patch.reference_model(model)
    max_len = N_CTX + queries.shape[1]
    full = session.score_continuations(ref, session.prefill_context(ref, context, max_len),
                                       queries, attention=True).attn_contrib
    ctx = session.prefill_context(compressed, context, max_len)
    a = session.score_continuations(compressed, ctx, queries, attention=True).attn_contrib
    b = session.score_continuations(patched, ctx, queries, attention=True).attn_contrib
    return session.attention_error(a, full), session.attention_error(b, full)


@struct.dataclass
class RoundingKVCache(KVCache):
    """Test-only quantized codec: K and V rounded per token and head to `levels` uniform
    levels of their absmax (dense layout). Stands in for a real quantizer (e.g. TaSQ)."""

    levels: int = struct.field(pytree_node=False, default=3)

    def init(self, batch, max_len, n_kv_heads, head_dim):
        shape = (batch, max_len, n_kv_heads, head_dim)
        return {"k": jnp.zeros(shape), "v": jnp.zeros(shape)}

    def _round(self, x):
        scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / (self.levels // 2) + 1e-12
        return jnp.round(x / scale) * scale

    def code_keys(self, k):
        return self._round(k)

    def code_values(self, v):
        return self._round(v)

    def update_and_attend(self, state, q, k, v, *, start, n_new, window):
        max_len = state["k"].shape[1]
        slots = write_positions(start, n_new, q.shape[1], max_len)
        state = {"k": scatter_tokens(state["k"], slots, self.code_keys(k)),
                 "v": scatter_tokens(state["v"], slots, self.code_values(v))}
        q_pos = start[:, None] + jnp.arange(q.shape[1])[None, :]
        kv_pos = jnp.broadcast_to(jnp.arange(max_len)[None, :], (q.shape[0], max_len))
        out = attend(q, state["k"], state["v"], q_pos, kv_pos,
                     kv_pos < (start + n_new)[:, None], window)
        return out, state


@struct.dataclass
class ShrunkKeysKVCache(RoundingKVCache):
    """Test-only codec that stores keys times `key_scale` and values exactly: every logit
    over the cache is scaled by key_scale, a flattening a W_q scale of 1 / key_scale
    undoes (exactly in layer 0; above it the context's cache is what the unpatched model
    prefilled)."""

    key_scale: float = struct.field(pytree_node=False, default=0.8)

    def code_keys(self, k):
        return k * self.key_scale

    def code_values(self, v):
        return v


def rounding_kv(levels=3) -> Transform:
    def apply(model, state):
        return model.replace(caches=tuple(RoundingKVCache(levels=levels)
                                          for _ in model.caches))
    return Transform(lambda m, d: (), apply, f"rounding_kv({levels})")


def test_no_compression_gives_zero_patch(model, context, probed):
    state = patch.fit_patches(model, probed)  # dense f32 caches = the reference
    assert all(not np.any(np.asarray(d)) for d in state.deltas)
    assert patch.patch_nbytes(state) == 0
    near = calibrate_and_apply(chain(evict("snapkv", 1.0), patch.patchkv(probes=PROBES)),
                               model, _data(context))[1][1]
    for d, p in zip(near.deltas, model.params["layers"]):  # float rounding only
        assert float(jnp.linalg.norm(d)) <= 1e-4 * float(jnp.linalg.norm(p["wo"]))


def test_huge_regularisation_changes_nothing(model, context, queries):
    t = chain(evict("streaming_llm", 0.2),
              patch.patchkv(probes=PROBES, ridge_config=RidgeConfig(selection="fixed",
                                                                      alpha=1e12)))
    patched, (_, state) = calibrate_and_apply(t, model, _data(context))
    for d, p in zip(state.deltas, model.params["layers"]):
        assert float(jnp.max(jnp.abs(d))) < 1e-8 * float(jnp.max(jnp.abs(p["wo"])))
    compressed = evict("streaming_llm", 0.2).apply(model, ())
    a, b = _attention_error(model, compressed, patched, context, queries)
    assert abs(a - b) < 1e-6


@pytest.mark.parametrize("policy", ["streaming_llm", "h2o", "snapkv", "random", "knorm"])
def test_chain_with_every_eviction_policy_reduces_attention_error(model, context, queries,
                                                                   policy):
    t = chain(evict(policy, 0.25), patch.patchkv(probes=PROBES))
    patched, (_, state) = calibrate_and_apply(t, model, _data(context))
    assert all(np.all(np.isfinite(np.asarray(d))) for d in state.deltas)
    compressed = evict(policy, 0.25).apply(model, ())
    before, after = _attention_error(model, compressed, patched, context, queries)
    assert after < before, (policy, before, after)
    summary = patch.summarize(state)
    assert summary["val_err_after"] <= summary["val_err_before"]
    assert "patchkv" in patched.tags and "evict-" + policy.split("_")[0] in "".join(
        patched.tags)


def test_chain_with_a_quantized_cache(model, context, queries):
    patched, (_, state) = calibrate_and_apply(chain(rounding_kv(3), patch.patchkv(
        probes=PROBES)), model, _data(context))
    assert patch.summarize(state)["layers_patched"] >= 1
    compressed = rounding_kv(3).apply(model, ())
    before, after = _attention_error(model, compressed, patched, context, queries)
    assert after < before, (before, after)


def test_layerwise_runner_matches_the_full_forward(model, probed):
    """Running probe rows layer by layer over the prefilled reference cache reproduces the
    core forward's hidden state; finish_layer reproduces the block from its attention."""
    from research.model import forward
    from research.patchkv import layerwise
    ref = patch.reference_model(model)
    probes = probed.probes
    states = session.tile_states(probed.ref_states, probes.context)
    start = jnp.full((len(probes.lengths),), N_CTX, jnp.int32)
    out = forward(ref, jnp.asarray(probes.tokens), cache_states=states, start=start,
                  n_new=jnp.asarray(probes.lengths), capture=True)
    for layer in range(model.config.n_layers):
        np.testing.assert_allclose(probed.reference.captures[layer]["attn"],
                                   out.captures[layer]["attn"], atol=2e-5, rtol=1e-4)
    view = layerwise.layer_view(ref, 1)
    x = probed.reference.hidden[1]
    x_out, cap = layerwise.run_layer(view, x, start, jnp.asarray(probes.lengths),
                                     states[1])
    again = layerwise.finish_layer(view, x, cap["attn"], view.params["layers"][0]["wo"])
    np.testing.assert_allclose(again, x_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(x_out, probed.reference.hidden[2], atol=1e-5, rtol=1e-5)


def assert_same_shapes_and_decode_flops(patched, compressed):
    """The patched model's params have the unpatched shapes/dtypes and its compiled decode
    step the same XLA FLOP count."""
    assert session.param_shapes(patched) == session.param_shapes(compressed)
    states, lengths = compressed.init_cache(2, 128), [N_CTX] * 2
    flops = session.decode_flops(compressed, states, lengths)
    assert session.decode_flops(patched, states, lengths) == flops > 0


def test_zero_per_query_overhead(model, probed):
    compressed = evict("snapkv", 0.25).apply(model, ())
    fitted = patch.fit_patches(compressed, probed)
    patched = patch.patchkv(probes=PROBES).apply(compressed, fitted)
    assert_same_shapes_and_decode_flops(patched, compressed)
    c = model.config  # a W_q scale (quantised caches' patches) folds in the same way
    state = fitted._replace(query_scales=(np.full(c.n_heads, 1.5, np.float32),) * c.n_layers)
    scaled = patch.apply_patch(compressed, state)
    assert not np.allclose(scaled.params["layers"][0]["wq"], patched.params["layers"][0]["wq"])
    assert_same_shapes_and_decode_flops(scaled, compressed)


def test_sequential_and_independent_agree_on_layer_zero_only(model, probed):
    compressed = evict("h2o", 0.25).apply(model, ())
    seq = patch.fit_patches(compressed, probed, sequential=True)
    ind = patch.fit_patches(compressed, probed, sequential=False)
    np.testing.assert_allclose(seq.deltas[0], ind.deltas[0], rtol=1e-5, atol=1e-7)
    assert not np.allclose(seq.deltas[1], ind.deltas[1])
    only = patch.fit_patches(compressed, probed, layers=[1])
    assert not np.any(np.asarray(only.deltas[0])) and len(only.fits) == 1
    res = patch.fit_patches(compressed, probed, target="residual")
    assert all(np.all(np.isfinite(np.asarray(d))) for d in res.deltas)


def test_gcv_selection_and_batched_contexts(model, context):
    compressed = evict("knorm", 0.25).apply(model, ())
    two = CalibrationData(jnp.asarray(np.stack([context, context[::-1]])),
                          jnp.asarray([N_CTX, N_CTX - 20]))
    state = patch.fit_patches(compressed, probe_context(compressed, two, PROBES),
                              ridge_config=RidgeConfig(selection="gcv"))
    assert state.n_probe_tokens == 2 * 8 * 16
    assert all(np.all(np.isfinite(np.asarray(d))) for d in state.deltas)


def test_cache_side_baselines_reduce_attention_error(model, probed, queries):
    compressed = evict("snapkv", 0.25).apply(model, ())
    ref = patch.reference_model(model)
    _, cmp_states = session.prefill_batch(compressed, probed.tokens, probed.lengths,
                                          probed.max_len)

    def contrib(m, states):
        ctx = session.ContextCache(states, N_CTX, None)
        return session.score_continuations(m, ctx, queries, attention=True).attn_contrib

    full = contrib(ref, probed.ref_states)
    err0 = session.attention_error(contrib(compressed, cmp_states), full)
    for method in ("grkv", "am"):
        states = baselines.refit_values(compressed, cmp_states, probed, method=method)
        assert all(np.all(np.isfinite(np.asarray(s["v"]))) for s in states)
        assert session.attention_error(contrib(compressed, states), full) < err0, method
    assert np.any(np.asarray(states[0]["bias"]) != 0)  # "am" sets the mass bias
    with pytest.raises(ValueError, match="method"):
        baselines.refit_values(compressed, cmp_states, probed, method="kvmerger")
    with pytest.raises(TypeError, match="evicting"):
        baselines.refit_values(model, probed.ref_states, probed, method="grkv")


def test_bad_input(model, context):
    t = patch.patchkv(probes=PROBES)
    with pytest.raises(ValueError, match="context as calibration data"):
        t.calibrate(model, None)
    empty = CalibrationData(jnp.zeros((1, 8), jnp.int32), jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match="empty"):
        t.calibrate(model, empty)
    with pytest.raises(TypeError, match="CalibrationData"):
        t.calibrate(model, context)
    with pytest.raises(ValueError, match="target"):
        patch.patchkv(target="logits")
    with pytest.raises(ValueError, match="layers"):
        patch.patchkv(probes=PROBES, layers=[5]).calibrate(model, _data(context))
    with pytest.raises(TypeError, match="ProbedContext"):
        patch.fit_patches(model, _data(context))
    with pytest.raises(ValueError, match="probe row"):
        ProbeConfig(n_generated=0, n_repeat=0)
    with pytest.raises(ValueError, match="holdout"):
        ProbeConfig(holdout=1.0)
    with pytest.raises(ValueError, match="reply_prefix"):
        ProbeConfig(n_reply=2)
    with pytest.raises(ValueError, match="reply_prefix"):
        ProbeConfig(n_reply=2, length=4, reply_prefix=(1, 2, 3, 4))
    with pytest.raises(TypeError, match="PatchState"):
        t.apply(model, {"deltas": ()})
    with pytest.raises(ValueError, match="held out"):  # one probe row cannot be split
        patch.patchkv(probes=ProbeConfig(n_generated=0, n_repeat=1, length=8)).calibrate(
            evict("knorm", 0.5).apply(model, ()), _data(context))
    bad = patch.PatchState((jnp.zeros((3, 3)),) * 2, (), 0.0, 0.0, 0)
    with pytest.raises(ValueError, match="patch shape"):
        patch.apply_patch(model, bad)
    assert isinstance(model.caches[0], DenseKVCache)
    assert dataclasses.is_dataclass(RoundingKVCache)


def test_reduced_rank_patch_is_low_rank_stored_as_factors_and_still_helps(model, context,
                                                                           queries, probed):
    compressed = evict("snapkv", 0.25).apply(model, ())
    _, states = session.prefill_batch(compressed, probed.tokens, probed.lengths,
                                      probed.max_len)
    config = RidgeConfig(ranks=(2, 4, 8), allow_full_rank=False)
    state = patch.fit_patches(compressed, probed, states=states, ridge_config=config)
    fitted = [f for f in state.fits if np.isfinite(f.alpha)]
    assert fitted and all(f.rank in config.ranks for f in fitted), state.fits
    expected_bytes = 0
    for f in fitted:
        stored = state.deltas[f.layer]
        assert isinstance(stored, patch.LowRank) and stored.rank == f.rank
        assert stored.left.shape == (stored.shape[0], f.rank)
        assert stored.right.shape == (f.rank, stored.shape[1])
        d = np.asarray(patch.dense(stored))
        assert np.linalg.matrix_rank(d, tol=1e-5 * np.abs(d).max()) == f.rank
        expected_bytes += (f.rank * sum(d.shape)) * 4
    assert patch.patch_nbytes(state) == expected_bytes
    before, after = _attention_error(model, compressed, patch.apply_patch(compressed, state),
                                     context, queries)
    assert after < before, (before, after)


def test_strength_is_chosen_on_held_out_kl_and_scales_the_fitted_patch(model, probed):
    compressed = evict("streaming_llm", 0.25).apply(model, ())
    _, states = session.prefill_batch(compressed, probed.tokens, probed.lengths,
                                      probed.max_len)
    plain = patch.fit_patches(compressed, probed, states=states)
    chosen = patch.fit_patches(compressed, probed, states=states, strengths=(0.5, 1.0))
    kls = dict(chosen.strength_kl)
    assert set(kls) == {0.0, 0.5, 1.0}
    assert kls[chosen.strength] == min(kls.values())
    for a, b in zip(plain.deltas, chosen.deltas):
        np.testing.assert_allclose(np.asarray(b), chosen.strength * np.asarray(a), rtol=1e-6)
    # a harmful patch (large random deltas) loses to no patch
    rng = np.random.default_rng(0)
    noise = [jnp.asarray(rng.normal(scale=5.0, size=d.shape), jnp.float32)
             for d in plain.deltas]
    strength, noisy_kls = patch.select_strength(compressed, probed, states, noise, (1.0,))
    assert strength == 0.0 and dict(noisy_kls)[1.0] > dict(noisy_kls)[0.0] > 0.0


def test_bad_strengths_are_errors(model, probed):
    compressed = evict("snapkv", 0.25).apply(model, ())
    with pytest.raises(ValueError, match="strengths"):
        patch.fit_patches(compressed, probed, strengths=(-1.0,))
    no_holdout = probed._replace(probes=probed.probes._replace(
        holdout=np.zeros_like(probed.probes.holdout)))
    with pytest.raises(ValueError, match="holdout"):
        patch.fit_patches(compressed, no_holdout, strengths=(1.0,),
                          ridge_config=RidgeConfig(selection="gcv"))


def test_query_scale_undoes_flattened_logits(model, context, probed, queries):
    compressed = model.replace(caches=tuple(ShrunkKeysKVCache(key_scale=0.8)
                                            for _ in model.caches))
    _, states = session.prefill_batch(compressed, probed.tokens, probed.lengths,
                                      probed.max_len)
    state = patch.fit_patches(compressed, probed, states=states, strengths=(1.0,),
                              query_scales=(0.9, 1.25, 1.6))
    kls = dict(state.query_scale_kl)  # not 0: the unpatched model prefilled the context
    assert set(kls) == {0.9, 1.0, 1.25, 1.6}
    assert min(kls, key=kls.get) == 1.25 and kls[1.25] < 0.1 * kls[1.0], kls
    assert len(state.query_scales) == model.config.n_layers
    for scales in state.query_scales:  # every head of every layer: 1 / 0.8
        np.testing.assert_array_equal(scales, np.full(model.config.n_heads, 1.25, np.float32))
    patched = patch.apply_patch(compressed, state)
    before, after = _attention_error(model, compressed, patched, context, queries)
    assert after < 0.25 * before, (before, after)
    shapes = lambda m: jax.tree.map(lambda x: (x.shape, x.dtype), m.params)  # noqa: E731
    assert shapes(patched) == shapes(compressed)
    h = model.config.n_heads
    for p0, p1 in zip(compressed.params["layers"], patched.params["layers"]):
        np.testing.assert_allclose(np.asarray(p1["wq"]), 1.25 * np.asarray(p0["wq"]),
                                   rtol=1e-6)
    summary = patch.summarize(state)
    assert summary["query_scale"] == pytest.approx(1.25)
    assert patch.patch_nbytes(state) >= model.config.n_layers * h * 4


def test_query_scale_stays_one_without_compression(model, probed):
    none = patch.fit_patches(model, probed, query_scales=(0.8, 1.2))
    assert all(np.all(q == 1.0) for q in none.query_scales)
    assert patch.patch_nbytes(none) == 0 and dict(none.query_scale_kl)[1.0] < 1e-6


def test_bad_query_scales_are_errors(model, probed):
    with pytest.raises(ValueError, match="query_scales"):
        patch.fit_patches(model, probed, query_scales=(0.0,))
    no_holdout = probed._replace(probes=probed.probes._replace(
        holdout=np.zeros_like(probed.probes.holdout)))
    with pytest.raises(ValueError, match="held-out"):
        patch.fit_patches(model, no_holdout, query_scales=(1.2,),
                          ridge_config=RidgeConfig(selection="gcv"))
    with pytest.raises(ValueError, match="head scales"):
        patch.scaled_wq(model.params["layers"][0]["wq"], [1.0] * 3, model.config.head_dim)
    with pytest.raises(ValueError, match="query_scales has"):
        patch.patched_params(model, [jnp.zeros_like(p["wo"]) for p in model.params["layers"]],
                             [np.ones(model.config.n_heads)])


def test_reply_probes_open_with_the_prefix_and_continue_as_the_reference_would(model,
                                                                             context):
    prefix = (5, 6, 7)
    cfg = ProbeConfig(n_generated=2, n_repeat=0, n_reply=3, length=10,
                      reply_prefix=prefix, temperature=1e-4, seed=0)
    probed = probe_context(model, _data(context), cfg)
    probes = probed.probes
    reply = probes.kind == "reply"
    assert reply.sum() == 3 and probes.holdout[reply].sum() == 1
    assert np.all(probes.tokens[reply][:, :3] == prefix)
    assert np.all(probes.lengths[reply] == 10)
    # (near-)greedy replies: each token is the full-cache model's argmax after the
    # context + prefix + the reply so far
    row = probes.tokens[reply][0]
    ref = patch.reference_model(model)
    logits = forward(ref, jnp.asarray(np.concatenate([context, row])[None])).logits[0]
    np.testing.assert_array_equal(np.argmax(logits[N_CTX + 2:-1], axis=-1), row[3:])


def test_refit_transforms_prefill_the_refit_cache_and_chain_with_patchkv(model, probed,
                                                                          queries):
    """grkv()/am() as per-context transforms: the model they return prefills the context
    into exactly the refit_values cache, serves queries like the evicting cache, and
    patchkv() chained after them fits over that cache."""
    press = evict("snapkv", 0.25)
    compressed = press.apply(model, ())
    _, cmp_states = session.prefill_batch(compressed, probed.tokens, probed.lengths,
                                          probed.max_len)
    for method, transform in (("grkv", baselines.grkv(probes=PROBES)),
                              ("am", baselines.am(probes=PROBES))):
        want = baselines.refit_values(compressed, cmp_states, probed, method=method)
        refit, (_, state) = calibrate_and_apply(chain(press, transform), model, probed)
        assert isinstance(refit.caches[0], baselines.RefitKVCache)
        assert refit.caches[0].describe().startswith("refit[evict[snapkv")
        _, got = session.prefill_batch(refit, probed.tokens, probed.lengths, probed.max_len)
        for g, w in zip(got, want):
            for key in ("k", "v", "pos", "bias", "n"):
                np.testing.assert_array_equal(np.asarray(g[key]), np.asarray(w[key]))
        ctx = session.ContextCache(got, N_CTX, None)
        a = session.score_continuations(refit, ctx, queries)
        b = session.score_continuations(compressed, ctx, queries)
        assert a.nll == pytest.approx(b.nll, rel=1e-6)  # queries append as evict does
    both = chain(press, baselines.grkv(probes=PROBES), patch.patchkv(probes=PROBES))
    patched, states = calibrate_and_apply(both, model, probed)
    assert len(states) == 3 and isinstance(states[2], patch.PatchState)
    assert patched.tags[-1] == "patchkv" and "grkv" in patched.tags


def test_refit_transform_bad_input(model, probed):
    with pytest.raises(ValueError, match="method must be one of"):
        baselines.value_refit("kvmerger")
    with pytest.raises(TypeError, match="probes must be a ProbeConfig"):
        baselines.grkv(probes={"n_generated": 4})
    with pytest.raises(TypeError, match="need an evicting cache"):
        baselines.grkv(probes=PROBES).apply(model, tuple((None, None) for _ in model.caches))
    with pytest.raises(ValueError, match="was built with"):  # the shared probes differ
        patch.patchkv(probes=dataclasses.replace(PROBES, seed=1)).calibrate(
            evict("snapkv", 0.25).apply(model, ()), probed)
