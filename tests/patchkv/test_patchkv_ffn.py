"""PatchKV's W_down (FFN) patch and text probe rows, on the tiny random model of
test_patchkv_patch: the FFN hidden activations match the block, no compression gives a
zero patch, the patch lowers the layer-output error on held-out probes and the logit error
on evaluation queries, folds in at zero per-query cost, and bad input is an error."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.eviction.press import evict
from research.model import init_params, make_model, tiny_config
from research.model.config import MoEConfig
from research.patchkv import layerwise, patch, session
from research.patchkv.probes import ProbeConfig, probe_context
from research.patchkv.ridge import RidgeConfig
from tests.patchkv.test_patchkv_patch import (  # noqa: F401 (fixtures)
    N_CTX, PROBES, _data, assert_same_shapes_and_decode_flops, context, model, probed,
    queries, rounding_kv)


@pytest.fixture(scope="module")
def probed16(model, context):  # the W_down patch has more inputs: 12 fitted rows, not 6
    return probe_context(model, _data(context), ProbeConfig(n_generated=16, n_repeat=0,
                                                            length=16))


def _logit_error(model, candidate, context, queries):
    """Relative error of the evaluation queries' logits over `candidate`'s cache (the
    context prefilled by `candidate` without its patch: same caches) vs the full cache."""
    max_len = N_CTX + queries.shape[1]
    ref = patch.reference_model(model)

    def logits(m, prefill_with):
        ctx = session.prefill_context(prefill_with, context, max_len)
        q = queries.shape[0]
        states = session.tile_states(ctx.states, np.zeros(q, np.int32))
        out, _ = session.query_forward(m, jnp.asarray(queries), jnp.full((q,), N_CTX),
                                       jnp.full((q,), queries.shape[1]), states)
        return out

    full = logits(ref, ref)
    return lambda m, unpatched: float(jnp.linalg.norm(logits(m, unpatched) - full)
                                      / jnp.linalg.norm(full))


def test_ffn_hidden_is_what_w_down_reads(model, probed):
    view = layerwise.layer_view(model, 1)
    x = probed.reference.hidden[1]
    attn = probed.reference.captures[1]["attn"]
    p = view.params["layers"][0]
    x_mid = x + attn @ p["wo"]
    np.testing.assert_allclose(x_mid + layerwise.ffn_hidden(view, x_mid) @ p["w_down"],
                               layerwise.finish_layer(view, x, attn, p["wo"]),
                               atol=1e-5, rtol=1e-5)


def test_no_compression_gives_zero_ffn_patch(model, probed):
    state = patch.fit_patches(model, probed, ffn=True)
    assert len(state.ffn_deltas) == model.config.n_layers
    assert all(not np.any(np.asarray(d)) for d in state.ffn_deltas + state.deltas)


def test_ffn_patch_lowers_held_out_and_evaluation_error(model, context, queries,
                                                       probed16):
    for compressed in (evict("snapkv", 0.25).apply(model, ()),
                       rounding_kv(3).apply(model, ())):
        wo_only = patch.fit_patches(compressed, probed16)
        both = patch.fit_patches(compressed, probed16, ffn=True)
        # the W_o patches are fit before the FFN patch of their layer: layer 0's agree
        np.testing.assert_allclose(both.deltas[0], wo_only.deltas[0], atol=1e-6)
        fitted = [f for f in both.ffn_fits if np.isfinite(f.alpha)]
        assert fitted and all(f.val_rel_err[1] < f.val_rel_err[0] for f in fitted)
        err = _logit_error(model, compressed, context, queries)
        none = err(compressed, compressed)
        patched = err(patch.apply_patch(compressed, both), compressed)
        assert patched < none, (patched, none)
        summary = patch.summarize(both)
        assert summary["ffn_layers_patched"] == len(fitted)
        assert summary["ffn_val_err_after"] < summary["ffn_val_err_before"]
        assert patch.patch_nbytes(both) > patch.patch_nbytes(wo_only) > 0


def test_huge_regularisation_leaves_w_down_alone(model, probed16):
    compressed = evict("snapkv", 0.25).apply(model, ())
    state = patch.fit_patches(compressed, probed16, ffn=True, ridge_config=RidgeConfig(
        selection="fixed", alpha=1e12))
    for d, p in zip(state.ffn_deltas, model.params["layers"]):
        assert float(jnp.max(jnp.abs(d))) < 1e-8 * float(jnp.max(jnp.abs(p["w_down"])))


def test_ffn_patch_has_zero_per_query_overhead_and_scales_with_strength(model, probed16):
    compressed = evict("snapkv", 0.25).apply(model, ())
    plain = patch.fit_patches(compressed, probed16, ffn=True)
    chosen = patch.fit_patches(compressed, probed16, ffn=True, strengths=(0.5, 1.0))
    for a, b in zip(plain.ffn_deltas, chosen.ffn_deltas):
        np.testing.assert_allclose(np.asarray(a) * chosen.strength, b, atol=1e-6)
    patched = patch.apply_patch(compressed, plain)
    assert not np.allclose(patched.params["layers"][1]["w_down"],
                           compressed.params["layers"][1]["w_down"])
    assert_same_shapes_and_decode_flops(patched, compressed)


def test_ffn_patch_bad_input(model, probed):
    config = tiny_config(vocab_size=97, dim=48, n_heads=4, n_kv_heads=2, head_dim=12,
                         ffn_dim=96, moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=32))
    moe_model = make_model(config, init_params(config, jax.random.key(0)))
    with pytest.raises(ValueError, match="MoE"):
        patch.fit_patches(moe_model, probed, ffn=True)
    zeros = [jnp.zeros_like(p["wo"]) for p in model.params["layers"]]
    with pytest.raises(ValueError, match="ffn_deltas has"):
        patch.patched_params(model, zeros, (), zeros[:1])
    with pytest.raises(ValueError, match="ffn patch shape"):
        patch.patched_params(model, zeros, (), zeros)


TEXT = np.random.default_rng(5).integers(0, 97, 200).astype(np.int32)  # a token pool


def test_text_rows_are_disjoint_spans_of_the_pool_and_leave_other_rows_alone(model,
                                                                             context):
    cfg = ProbeConfig(n_generated=4, n_repeat=2, length=16, seed=0)
    plain = probe_context(model, _data(context), cfg).probes
    probes = probe_context(model, _data(context), ProbeConfig(
        **{**cfg.__dict__, "n_text": 8}), TEXT).probes
    text = probes.kind == "text"
    assert text.sum() == 8 and probes.holdout[text].sum() == 2
    starts = [int(np.flatnonzero(np.all(
        np.lib.stride_tricks.sliding_window_view(TEXT, 16) == row, axis=1))[0])
        for row in probes.tokens[text]]
    assert all(s % 16 == 0 for s in starts) and len(set(starts)) == 8  # 12 slots, no repeat
    np.testing.assert_array_equal(probes.tokens[~text], plain.tokens)
    np.testing.assert_array_equal(probes.holdout[~text], plain.holdout)
    assert np.all(probes.lengths[text] == 16)


def test_text_rows_bad_input(model, context):
    cfg = ProbeConfig(n_generated=0, n_text=4, length=16)
    with pytest.raises(ValueError, match="text pool"):
        probe_context(model, _data(context), cfg)
    with pytest.raises(ValueError, match="n_text=4 needs"):
        probe_context(model, _data(context), cfg, TEXT[:40])
    with pytest.raises(ValueError, match="1-D integer"):
        probe_context(model, _data(context), cfg, TEXT.reshape(2, 100))
    with pytest.raises(ValueError, match=r"\[0, 97\)"):
        probe_context(model, _data(context), cfg, TEXT + 97)
    with pytest.raises(ValueError, match="n_text"):
        ProbeConfig(n_text=-1)
    probes = probe_context(model, _data(context), cfg, TEXT).probes  # text rows alone
    assert set(probes.kind) == {"text"} and len(probes.kind) == 4
