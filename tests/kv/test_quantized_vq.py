"""VQCodec in the dense layout: codes-attention equals dense attention on the decoded K/V; writes, decode
consistency, the Pallas path, bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.vq_attention.reference import dequantize
from research.kv.base import state_nbytes
from research.kv.dense import DenseKVCache
from research.tasq.vq import VQCodec, codes_last, encode, inverse_permutation, permute_channels

B, HQ, HKV, D, G, K = 2, 4, 2, 16, 2, 32


def _cache(seed=0, shared=False, **static):
    rng = np.random.default_rng(seed)
    hc = 1 if shared else HKV
    return DenseKVCache(VQCodec.create(rng.normal(size=(hc, G, K, D // G)).astype(np.float32),
                            rng.normal(size=(hc, G, K, D // G)).astype(np.float32),
                            np.stack([rng.permutation(D) for _ in range(HKV)]),
                            np.stack([rng.permutation(D) for _ in range(HKV)]), **static))


def _qkv(seed, t):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(B, t, h, D)), jnp.float32)
                 for h in (HQ, HKV, HKV))


def _decoded(cache, state, name):
    """Dense K or V (model channel order) rebuilt from the cache's codes."""
    codec = cache.codec
    cb = codec.key_codebook if name == "k" else codec.value_codebook
    perm = codec.key_perm if name == "k" else codec.value_perm
    x = dequantize(codes_last(state[f"{name}_codes"]), cb)  # codec order [B, S, H, D]
    return permute_channels(x, inverse_permutation(perm))


def _step(cache, state, q, k, v, start, n_new, window=None):
    return jax.jit(lambda c, s, q, k, v, a, n: c.update_and_attend(
        s, q, k, v, start=a, n_new=n, window=window))(cache, state, q, k, v, start, n_new)


@pytest.mark.parametrize("t,max_len,shared", [(6, 9, False), (1, 70, True), (12, 12, True)])
def test_matches_dense_attention_on_decoded_kv(t, max_len, shared):
    """Both formulations (lookup tables for short chunks, blockwise for long ones) equal
    dense attention over the K/V the codes decode to (older slots included)."""
    cache = _cache(shared=shared)
    q, k, v = _qkv(1, t)
    start, n_new = jnp.array([0, 2]), jnp.array([t, t - 1])
    rng = np.random.default_rng(2)
    state0 = {name: jnp.asarray(rng.integers(0, K, (B, max_len, HKV, G)), jnp.uint8)
              for name in ("k_codes", "v_codes")}  # earlier tokens of row 1 already cached
    out, state = _step(cache, state0, q, k, v, start, n_new)
    assert cache.codec.use_lookup_tables(t, HQ // HKV, max_len) == (t == 1)
    keys, vals = _decoded(cache, state, "k"), _decoded(cache, state, "v")
    dense = DenseKVCache()
    ref, _ = dense.update_and_attend({"k": keys, "v": vals}, q, _gather(keys, start, t),
                                     _gather(vals, start, t), start=start, n_new=n_new,
                                     window=None)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def _gather(x, start, t):
    """x[b, start[b] + i] for i < t (the chunk's decoded tokens)."""
    idx = jnp.clip(start[:, None] + jnp.arange(t)[None], 0, x.shape[1] - 1)
    return x[jnp.arange(x.shape[0])[:, None], idx]


def test_codes_are_nearest_centroids_in_codec_order():
    cache = _cache(shared=True)
    _, k, _ = _qkv(2, 5)
    codes = encode(permute_channels(k, cache.codec.key_perm), cache.codec.key_codebook)
    kp = permute_channels(k, cache.codec.key_perm).reshape(B, 5, HKV, G, D // G)
    d = jnp.sum((kp[..., None, :] - cache.codec.key_codebook[0][None, None, None]) ** 2, -1)
    chosen = jnp.take_along_axis(d, codes[..., None].astype(jnp.int32), -1)[..., 0]
    np.testing.assert_allclose(chosen, d.min(-1), rtol=1e-4, atol=1e-6)


def test_prefill_then_decode_equals_one_prefill():
    """Writing a sequence in chunks gives the same codes and outputs as one prefill."""
    cache = _cache(seed=3)
    t = 7
    q, k, v = _qkv(4, t)
    lengths = jnp.array([t, t])
    out_all, st_all = _step(cache, cache.init(B, 10, HKV, D), q, k, v, jnp.zeros(2, int),
                            lengths)
    st = cache.init(B, 10, HKV, D)
    outs = []
    pre = 4
    o, st = _step(cache, st, q[:, :pre], k[:, :pre], v[:, :pre], jnp.zeros(2, int),
                  jnp.array([pre, pre]))
    outs.append(o)
    for i in range(pre, t):
        o, st = _step(cache, st, q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1],
                      jnp.array([i, i]), jnp.array([1, 1]))
        outs.append(o)
    np.testing.assert_array_equal(st["k_codes"], st_all["k_codes"])
    np.testing.assert_array_equal(st["v_codes"], st_all["v_codes"])
    np.testing.assert_allclose(jnp.concatenate(outs, 1), out_all, rtol=1e-5, atol=1e-5)


def test_padding_tokens_are_not_written():
    cache = _cache()
    q, k, v = _qkv(5, 3)
    st0 = cache.init(B, 8, HKV, D)
    _, st = _step(cache, st0, q, k, v, jnp.array([0, 0]), jnp.array([3, 0]))
    assert int(jnp.abs(st["k_codes"][1].astype(int)).sum()) == 0
    _, st_full = _step(cache, st0, q, k, v, jnp.array([0, 0]), jnp.array([3, 3]))
    assert int(jnp.abs(st_full["k_codes"][1].astype(int)).sum()) > 0


def test_pallas_decode_path_matches_xla():
    xla, pallas = _cache(seed=6), _cache(seed=6, implementation="pallas", interpret=True)
    q, k, v = _qkv(7, 1)
    rng = np.random.default_rng(8)
    state = {name: jnp.asarray(rng.integers(0, K, (B, 50, HKV, G)), jnp.uint8)
             for name in ("k_codes", "v_codes")}
    start, n_new = jnp.array([49, 20]), jnp.array([1, 1])
    a, sa = _step(xla, state, q, k, v, start, n_new)
    b, sb = _step(pallas, state, q, k, v, start, n_new)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(sa["k_codes"], sb["k_codes"])


def test_state_is_one_byte_per_group():
    cache = _cache()
    st = jax.eval_shape(lambda: cache.init(3, 100, HKV, D))
    assert state_nbytes(st) == 2 * 3 * 100 * HKV * G


def test_bad_construction_raises():
    good = np.zeros((1, G, K, D // G), np.float32)
    with pytest.raises(TypeError, match="key_codebook"):
        VQCodec.create(good.astype(np.int32), good)
    with pytest.raises(ValueError, match="value_codebook"):
        VQCodec.create(good, np.full_like(good, np.nan))
    with pytest.raises(ValueError, match="key_perm"):
        VQCodec.create(good, good, key_perm=np.zeros((1, D), int))
    with pytest.raises(ValueError, match="256"):
        VQCodec.create(np.zeros((1, G, 300, D // G), np.float32),
                         np.zeros((1, G, 300, D // G), np.float32))
    with pytest.raises(ValueError, match="implementation"):
        _cache(implementation="cuda")
    with pytest.raises(ValueError, match="head_dim"):
        _cache().init(1, 4, HKV, D + 2)
    with pytest.raises(ValueError, match="KV heads|1 or"):
        _cache().init(1, 4, HKV + 1, D)


def test_nonfinite_kv_is_an_error_not_a_silent_code():
    cache = _cache()
    q, k, v = _qkv(9, 2)
    k_bad = k.at[0, 1, 0, 3].set(jnp.nan)
    st = cache.init(B, 4, HKV, D)
    start, n_new = jnp.array([0, 0]), jnp.array([2, 2])
    with pytest.raises(ValueError, match="k contains NaN"):  # eager: checked now
        cache.update_and_attend(st, q, k_bad, v, start=start, n_new=n_new, window=None)
    out, _ = _step(cache, st, q, k_bad, v, start, n_new)  # under jit: poisoned row, not junk
    assert bool(jnp.isnan(out[0]).all()) and bool(jnp.isfinite(out[1]).all())
    checked = _cache(check_finite_in_jit=True)
    with pytest.raises(Exception, match="v contains NaN"):
        _step(checked, st, q, k, v.at[1, 0, 1, 0].set(jnp.inf), start, n_new)[0].block_until_ready()
