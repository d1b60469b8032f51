"""TaSQ with key_read="rotated_table": pair-aligned pre-RoPE key groups, and a model whose
caches score keys through rotated per-query tables gives the logits of the same codes read
by rebuilding keys (key_read="rebuild"), in the dense and the paged layout."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.vq_attention.rotated import pair_aligned
from research.kv.dense import DenseKVCache
from research.kv.paged import PagedKVCache
from research.model import forward, init_params, make_model, tiny_config
from research.tasq import TaSQConfig, tasq
from research.tasq import cq
from research.tasq.cq import CQCodec
from research.transforms import CalibrationData, calibrate_and_apply

# head_dim 16 -> two 8-channel (4-pair) groups per head at 1 bit
CFG = TaSQConfig(kmeans_iters=3, max_points=256, key_read="rotated_table")
MAX_LEN = 64


@functools.cache
def _calibrated(channel_grouping: bool = True):
    config = tiny_config(head_dim=16, n_heads=4, n_kv_heads=2, max_position=MAX_LEN)
    model = make_model(config, init_params(config, jax.random.key(0)))
    ids = np.random.default_rng(0).integers(0, 97, 4 * 64)
    cfg = TaSQConfig(**{**CFG.to_dict(), "channel_grouping": channel_grouping})
    return calibrate_and_apply(tasq(cfg), model, CalibrationData.from_ids(ids, 64, 4))


@pytest.mark.parametrize("channel_grouping", [True, False])
def test_key_groups_hold_whole_rope_pairs(channel_grouping):
    model, state = _calibrated(channel_grouping)
    assert all(pair_aligned(p, 8) for p in np.asarray(state.key_perm))
    codecs = [c.codec for c in model.caches]
    assert all(isinstance(c, CQCodec) and c.key_read == "rotated_table" for c in codecs)
    assert "rotated-table" in codecs[0].describe()


def _logits(model, layout, implementation):
    """Logits of a prefill chunk of 7 and then 3 decode steps (batch 2, ragged)."""
    def cache(codec):
        codec = codec.replace(implementation=implementation)
        if layout == "dense":
            return DenseKVCache(codec)
        return PagedKVCache(codec, block_size=4, n_blocks=2 * MAX_LEN // 4)
    model = model.replace(caches=tuple(cache(c.codec) for c in model.caches))
    step = jax.jit(lambda m, t, s, st, n: forward(m, t, cache_states=s, start=st, n_new=n,
                                                  logits="last"))
    rng = np.random.default_rng(4)
    states = model.init_cache(2, MAX_LEN)
    start = jnp.zeros((2,), jnp.int32)
    toks = jnp.asarray(rng.integers(0, 97, (2, 7)), jnp.int32)
    n_new = jnp.asarray([7, 6], jnp.int32)
    outs = []
    for _ in range(4):
        out = step(model, toks, states, start, n_new)
        outs.append(np.asarray(out.logits))
        states, start = out.cache_states, start + n_new
        toks = jnp.asarray(rng.integers(0, 97, (2, 1)), jnp.int32)
        n_new = jnp.ones((2,), jnp.int32)
    return np.stack(outs)


# "xla" in the dense layout: the codec's own read; "auto" in pages: on CPU the layout
# gathers the pages and the codec picks the rotated read by platform
@pytest.mark.parametrize("layout,implementation", [("dense", "xla"), ("paged", "auto")])
def test_rotated_read_gives_the_rebuilt_key_logits(layout, implementation, monkeypatch):
    model, _ = _calibrated()
    rebuilt = model.replace(caches=tuple(c.replace(codec=c.codec.replace(key_read="rebuild"))
                                         for c in model.caches))
    want = _logits(rebuilt, layout, implementation)
    calls = []
    read = cq.vq_attention_rotated
    monkeypatch.setattr(cq, "vq_attention_rotated", lambda *a, **k: calls.append(1) or read(
        *a, **k))
    got = _logits(model, layout, implementation)
    assert calls  # decode steps (traced once per layer) took the rotated-table read
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="key_read"):
        TaSQConfig(key_read="table")
    with pytest.raises(ValueError, match="pre-RoPE"):
        TaSQConfig(key_read="rotated_table", key_space="post_rope")
    book = jnp.zeros((1, 2, 4, 8), jnp.float32)
    with pytest.raises(ValueError, match="whole RoPE pairs"):
        CQCodec(book, book, key_perm=jnp.tile(jnp.arange(16), (1, 1)),
                key_read="rotated_table")
    with pytest.raises(ValueError, match="key_read"):
        CQCodec(book, book, key_read="lut")
