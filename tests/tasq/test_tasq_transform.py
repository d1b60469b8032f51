"""TaSQ transform end to end on a tiny model: calibrate, fold, VQ caches, artifacts, errors."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.eval.perplexity import perplexity
from research.tasq.vq import VQCodec
from research.decode.generate import generate
from research.model import forward, init_params, make_model, tiny_config
from research.tasq import TaSQConfig, plain_vq, tasq
from research.tasq.transform import apply_state
from research.tasq.artifacts import restore_state, save_state
from research.tasq.baselines import cq_style, int8_kv, kivi_kv, sign_kv
from research.tasq.metrics import (attention_output_error, bits_per_channel,
                                   cache_param_bytes, max_batch_with_codebooks)
from research.transforms import CalibrationData, calibrate_and_apply

# head_dim 16 -> two 8-channel groups at 1 bit; few k-means points keep this fast
# post-RoPE keys (the lookup-table codec) pinned: TaSQ's default key space is chosen on dev
CFG = TaSQConfig(kmeans_iters=3, max_points=256, share_codebooks=True, key_space="post_rope")


@pytest.fixture(scope="module")
def model16():
    config = tiny_config(head_dim=16, n_heads=4, n_kv_heads=2)
    return make_model(config, init_params(config, jax.random.key(0)))


@pytest.fixture(scope="module")
def calib():
    ids = np.random.default_rng(0).integers(0, 97, 4 * 64)
    return CalibrationData.from_ids(ids, 64, 4)


@pytest.fixture(scope="module")
def calibrated(model16, calib):
    return calibrate_and_apply(tasq(CFG), model16, calib)


def test_calibrated_model_uses_vq_caches_and_runs(calibrated, model16):
    m, state = calibrated
    assert all(isinstance(c.codec, VQCodec) for c in m.caches) and "tasq" in m.tags
    c = model16.config
    assert state.key_codebook.shape == (c.n_layers, 1, 2, 256, 8)  # shared, 2 groups of 8
    np.testing.assert_array_equal(np.sort(state.key_perm, -1),
                                  np.broadcast_to(np.arange(16), state.key_perm.shape))
    # keys are grouped by RoPE pairs
    for row in np.asarray(state.key_perm).reshape(-1, 16):
        for g in range(2):
            grp = set(row[g * 8:(g + 1) * 8])
            assert all((ch + 8) % 16 in grp for ch in grp)
    ids = np.random.default_rng(1).integers(0, 97, 200)
    p = perplexity(m, ids, window=32, stride=16, batch_size=2, max_windows=4)
    assert np.isfinite(p.ppl)


def test_memory_is_one_bit_per_channel(calibrated, model16):
    m, _ = calibrated
    assert bits_per_channel(m, 1024) == pytest.approx(1.0)
    c = model16.config
    # codebooks: 2 (K, V) x layers x 2 groups x 256 x 8 f32, plus int32 permutations
    assert cache_param_bytes(m) == c.n_layers * (2 * 2 * 256 * 8 * 4 + 2 * 2 * 16 * 4)
    budget = 64 * 2 ** 20  # the f32 cache of model16 is 32 bits/ch: ~32x minus codebooks
    ratio = max_batch_with_codebooks(m, budget, 1024) / max_batch_with_codebooks(
        model16, budget, 1024)
    assert 28 <= ratio <= 32


def test_tasq_beats_plain_vq_on_attention_error_with_query_weighting(model16, calib):
    """On random weights the query/value weighting still lowers the output error."""
    toks = np.random.default_rng(2).integers(0, 97, (2, 48))
    plain, _ = calibrate_and_apply(plain_vq(kmeans_iters=3, max_points=256), model16, calib)
    weighted, _ = calibrate_and_apply(
        tasq(dataclasses.replace(CFG, head_normalization=False, channel_grouping=False,
                                 share_codebooks=False)), model16, calib)
    assert weighted.caches[0].codec.key_codebook.shape[0] == model16.config.n_kv_heads
    e_plain = attention_output_error(plain, toks)["mean"]
    e_weighted = attention_output_error(weighted, toks)["mean"]
    assert 0 < e_weighted < e_plain < 1.5


def test_pre_rope_key_space_codes_unrotated_keys(model16, calib):
    """key_space='pre_rope': same ingredients, keys coded before RoPE and rotated on read;
    1 bit per channel and finite, bounded attention error."""
    from research.tasq.cq import CQCodec
    cfg = dataclasses.replace(CFG, key_space="pre_rope")
    m, st = calibrate_and_apply(tasq(cfg), model16, calib)
    assert all(isinstance(c.codec, CQCodec) and c.codec.key_perm is not None for c in m.caches)
    assert bits_per_channel(m, 256) == pytest.approx(1.0)
    toks = np.random.default_rng(2).integers(0, 97, (2, 48))
    err = attention_output_error(m, toks)["mean"]
    assert 0 < err < 1.5
    pallas = apply_state(model16, dataclasses.replace(
        st, config=dataclasses.replace(cfg, implementation="pallas", interpret=True)))
    assert all(c.codec.implementation == "pallas" for c in pallas.caches)
    prompts = [list(range(3, 20)), [5, 6, 7]]
    assert (generate(pallas, prompts, max_new_tokens=4).tokens
            == generate(m, prompts, max_new_tokens=4).tokens)


def test_two_bits_uses_four_channel_groups(model16, calib):
    m, st = calibrate_and_apply(tasq(dataclasses.replace(CFG, bits=2)), model16, calib)
    assert st.key_codebook.shape[2:] == (4, 256, 4)
    assert bits_per_channel(m, 256) == pytest.approx(2.0)


def test_artifacts_roundtrip_and_fingerprint(calibrated, model16, tmp_path):
    m, state = calibrated
    path = save_state(tmp_path / "tasq", state)
    back = restore_state(path, model16)
    for name in ("key_scale", "value_perm", "key_codebook", "value_codebook"):
        np.testing.assert_array_equal(getattr(back, name), getattr(state, name))
    assert back.config == state.config and back.fingerprint == state.fingerprint
    m2 = tasq(CFG).apply(model16, back)
    toks = jnp.asarray(np.random.default_rng(3).integers(0, 97, (1, 10)), jnp.int32)
    st1, st2 = m.init_cache(1, 10), m2.init_cache(1, 10)
    fwd = jax.jit(lambda mm, st: forward(mm, toks, cache_states=st).logits)
    np.testing.assert_array_equal(fwd(m, st1), fwd(m2, st2))
    other = make_model(model16.config, init_params(model16.config, jax.random.key(9)))
    with pytest.raises(ValueError, match="different model"):
        restore_state(path, other)
    with pytest.raises(ValueError, match="different model"):
        tasq(CFG).apply(other, state)
    with pytest.raises(ValueError, match="different model"):  # applying twice
        tasq(CFG).apply(m, state)
    with pytest.raises(FileExistsError):
        save_state(path, state)
    with pytest.raises(FileNotFoundError):
        restore_state(tmp_path / "missing")


def test_bad_configs_and_data(model16, calib, tiny):
    with pytest.raises(ValueError, match="bits"):
        TaSQConfig(bits=3)
    with pytest.raises(ValueError, match="group_size"):
        TaSQConfig(bits=1, group_size=4)
    with pytest.raises(ValueError, match="head_dim"):  # tiny has head_dim 8: 2 bits ok, ...
        tasq(TaSQConfig(bits=1, group_size=8)).calibrate(
            make_model(tiny_config(head_dim=12), init_params(tiny_config(head_dim=12),
                                                             jax.random.key(0))), calib)
    with pytest.raises(ValueError, match="empty|non-empty"):
        tasq(CFG).calibrate(model16, CalibrationData(jnp.zeros((0, 4), jnp.int32),
                                                     jnp.zeros((0,), jnp.int32)))
    with pytest.raises(ValueError, match="required"):
        tasq(CFG).calibrate(model16, None)
    with pytest.raises(ValueError, match="calibrated with"):
        tasq(dataclasses.replace(CFG, bits=2)).apply(model16, tasq(CFG).calibrate(model16,
                                                                                   calib))


@pytest.mark.parametrize("make", [int8_kv, kivi_kv, sign_kv,
                                  lambda: cq_style(kmeans_iters=2, max_points=256)])
def test_baselines_apply_and_run(model16, calib, make):
    if make is kivi_kv:
        make = lambda: kivi_kv(bits=2, key_group=8, value_group=8, residual=8)  # noqa: E731
    m, _ = calibrate_and_apply(make(), model16, calib)
    toks = np.random.default_rng(4).integers(0, 97, (1, 24))
    err = attention_output_error(m, toks)["mean"]
    assert 0 < err < 2.0 and np.isfinite(err)


def test_served_calibration_positions_cover_the_served_range(model16, calib):
    """calibration_positions="served": post-RoPE keys are fitted at positions drawn over
    [0, max_position), not only the calibration text's 0-63: every key is the exact RoPE
    of its pre-RoPE key at a drawn position, and the draws reach the end of the range."""
    from research.core.rope import apply_rope
    from research.tasq.stats import collect
    from research.tasq.transform import calibration_keys, served_positions

    c = model16.config
    st = collect(model16, calib)[0]
    text = calibration_keys(st, CFG, c, np.random.default_rng(0))
    np.testing.assert_array_equal(text, st.k)  # the text's own positions 0-63
    served_cfg = dataclasses.replace(CFG, calibration_positions="served")
    served = calibration_keys(st, served_cfg, c, np.random.default_rng(1))
    pos = served_positions(len(st.k_pre), c.max_position, np.random.default_rng(1))
    want = apply_rope(jnp.asarray(st.k_pre)[None], jnp.asarray(pos)[None], c.rope_theta)[0]
    np.testing.assert_allclose(served, np.asarray(want), rtol=1e-6, atol=1e-6)
    assert pos.min() >= 0 and pos.max() < c.max_position
    many = served_positions(20000, 8192, np.random.default_rng(2))
    hist = np.histogram(many, bins=8, range=(0, 8192))[0]
    assert hist.min() > 0.8 * hist.mean()  # uniform over the whole range, 8k included
    assert many.max() > 8000 and 64 < np.median(many)
    # pre-RoPE codes are position-free: the option changes nothing there
    pre = dataclasses.replace(served_cfg, key_space="pre_rope")
    np.testing.assert_array_equal(calibration_keys(st, pre, c, np.random.default_rng(0)),
                                  st.k_pre)
    with pytest.raises(ValueError, match="calibration_positions"):
        TaSQConfig(calibration_positions="everywhere")
    # the model calibrates and serves with it
    served_model, _ = calibrate_and_apply(tasq(served_cfg), model16, calib)
    assert np.all(np.isfinite(np.asarray(forward(served_model, jnp.ones((1, 8), jnp.int32),
                                                 logits="last").logits)))
