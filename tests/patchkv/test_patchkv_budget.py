"""PatchKV's memory account: factored (rank-capped) patch storage, bytes of real arrays,
and the break-even context length, on a tiny random model."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.eviction import evict, trim_states
from research.model import forward, init_params, make_model, tiny_config
from research.patchkv import budget, patch, session
from research.patchkv.tasks import check_windows_in_split, continuation_tasks, split_range


@pytest.fixture(scope="module")
def model():
    config = tiny_config(vocab_size=97, dim=48, n_heads=4, n_kv_heads=2, head_dim=12,
                         ffn_dim=96)
    return make_model(config, init_params(config, jax.random.key(0)))


def _random_deltas(model, key, scale=0.05):
    ks = jax.random.split(key, 2 * model.config.n_layers)
    wo = [scale * jax.random.normal(k, p["wo"].shape)
          for k, p in zip(ks[::2], model.params["layers"])]
    wd = [scale * jax.random.normal(k, p["w_down"].shape)
          for k, p in zip(ks[1::2], model.params["layers"])]
    return wo, wd


def _logits(model, tokens):
    return forward(model, jnp.asarray(tokens)[None]).logits


def test_factored_patch_at_full_rank_gives_the_dense_patchs_outputs(model):
    wo, wd = _random_deltas(model, jax.random.key(1))
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (24,), 0, 97), np.int32)
    dense_state = patch.PatchState(tuple(wo), (), 0.0, 0.0, 0, ffn_deltas=tuple(wd))
    factored = dense_state._replace(
        deltas=tuple(patch.LowRank.from_dense(d) for d in wo),
        ffn_deltas=tuple(patch.LowRank.from_dense(d) for d in wd))
    assert all(f.rank == min(d.shape) for f, d in zip(factored.deltas, wo))
    out_dense = _logits(patch.apply_patch(model, dense_state), tokens)
    out_factored = _logits(patch.apply_patch(model, factored), tokens)
    out_plain = _logits(model, tokens)
    np.testing.assert_allclose(out_factored, out_dense, rtol=1e-4, atol=1e-5)
    assert float(jnp.max(jnp.abs(out_dense - out_plain))) > 1e-3  # the patch does act
    # truncating a rank-r delta to rank r is exact; to rank r - 1 it is not
    low = wo[0][:, :3] @ wo[0][:3, :]
    np.testing.assert_allclose(patch.LowRank.from_dense(low, 3).dense(), low, atol=1e-5)
    assert float(jnp.max(jnp.abs(patch.LowRank.from_dense(low, 2).dense() - low))) > 1e-4
    with pytest.raises(ValueError, match="rank must be an int"):
        patch.LowRank.from_dense(low, 0)


def test_patch_bytes_are_the_stored_arrays_bytes(model):
    wo, wd = _random_deltas(model, jax.random.key(3))
    r = 5
    deltas = tuple(patch.LowRank.from_dense(d, r) for d in wo)
    ffn = tuple(patch.LowRank.from_dense(d, r) for d in wd)
    zero = jnp.zeros_like(wo[0])  # an unpatched layer stores nothing
    state = patch.PatchState((zero,) + deltas[1:], (), 0.0, 0.0, 0, ffn_deltas=ffn)
    arrays = [a for lr in deltas[1:] + ffn for a in (lr.left, lr.right)]
    assert patch.patch_nbytes(state) == sum(int(a.nbytes) for a in arrays)
    d, f = model.config.dim, model.config.ffn_dim
    hd = model.config.n_heads * model.config.head_dim
    assert patch.patch_nbytes(state) == 4 * r * ((len(wo) - 1) * (hd + d) + len(wd) * (f + d))
    half = patch.cast_state(state, jnp.bfloat16)
    assert patch.patch_nbytes(half) * 2 == patch.patch_nbytes(state)
    assert all(lr.left.dtype == jnp.bfloat16 for lr in half.deltas[1:])
    # dense storage: the delta's own bytes; scaling keeps the storage
    dense_state = state._replace(deltas=tuple(wo), ffn_deltas=())
    assert patch.patch_nbytes(dense_state) == sum(int(a.nbytes) for a in wo)
    scaled = patch.scale_patch(deltas[1], 0.5)
    np.testing.assert_allclose(scaled.dense(), 0.5 * deltas[1].dense(), rtol=1e-6, atol=1e-7)
    assert scaled.nbytes == deltas[1].nbytes


def test_break_even_from_real_cache_bytes_separates_lengths_where_the_patch_pays(model):
    rng = np.random.default_rng(0)
    patch_bytes = 6000

    def kept(ratio, n):
        compressed = evict("snapkv", ratio).apply(model, ())
        ids = rng.integers(0, 97, n).astype(np.int32)
        _, states = session.prefill_batch(compressed, ids[None], [n], n)
        trimmed = trim_states(states, room=0)
        leaves = jax.tree.leaves(trimmed)
        floats = sum(int(a.nbytes) for a in leaves if jnp.issubdtype(a.dtype, jnp.floating))
        ints = sum(int(a.nbytes) for a in leaves) - floats  # slot counters stay int32
        half = budget.cache_nbytes(trimmed, jnp.bfloat16)
        assert half == floats // 2 + ints and budget.cache_nbytes(trimmed) == floats + ints
        return budget.cache_nbytes(trimmed), half

    n0 = 160
    (small, small16), (large, large16) = kept(0.1, n0), kept(0.25, n0)
    assert 0 < small < large and small16 < small and large16 < large
    even = budget.break_even_tokens(patch_bytes, small / n0, large / n0)
    assert even == pytest.approx(patch_bytes / ((large - small) / n0))
    # the same patch against (about) half the KV bytes per token pays later
    assert budget.break_even_tokens(patch_bytes, small16 / n0, large16 / n0) == \
        pytest.approx(2 * even, rel=0.05)
    # measured at lengths well below / above the break-even, the real totals agree
    below, above = int(even / 3), int(even * 3)
    for n, pays in ((below, False), (above, True)):
        (s, _), (lg, _) = kept(0.1, n), kept(0.25, n)
        assert (s + patch_bytes < lg) == pays, (n, s, lg, even)
    assert budget.break_even_tokens(0, 1.0, 2.0) == 0.0
    assert math.isinf(budget.break_even_tokens(10, 2.0, 2.0))
    with pytest.raises(ValueError, match="byte counts"):
        budget.break_even_tokens(-1, 1.0, 2.0)


def test_dev_and_test_contexts_are_disjoint_by_construction():
    n = 12570
    dev, test = split_range(n, "dev"), split_range(n, "test")
    assert dev == (0, n // 2) and test == (n // 2, n)
    ids = np.arange(n)
    for split in ("dev", "test"):
        lo, hi = split_range(n, split)
        tasks = continuation_tasks(ids[lo:hi], n_contexts=2, context_len=512,
                                   n_continuations=8, continuation_len=64)
        windows = [(lo + t.window[0], lo + t.window[1]) for t in tasks]
        check_windows_in_split(windows, n, split)
        other = test if split == "dev" else dev
        assert all(w[1] <= other[0] or w[0] >= other[1] for w in windows)
        assert all(np.all((t.context >= lo) & (t.context < hi)) for t in tasks)
    with pytest.raises(ValueError, match="dev and test contexts would overlap"):
        check_windows_in_split([(6000, 7000)], n, "dev")
    with pytest.raises(ValueError, match="split must be one of"):
        split_range(n, "train")
