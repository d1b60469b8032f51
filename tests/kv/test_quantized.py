"""Baseline codecs: bit packing, int8, KIVI-style, sign-bit (QJL-like) and CQ-style caches."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.kv.base import state_nbytes
from research.tasq.cq import CQCodec
from research.kv.dense import DenseKVCache
from research.tasq.kivi import KIVICodec
from research.kv.quantized import (Int8Codec, dequantize_uniform, pack_bits,
                                   quantize_uniform, unpack_bits)
from research.tasq.sign import SignCodec, gaussian_projection
from research.tasq.vq import permute_channels
from research.core.rope import apply_rope

B, HQ, HKV, D = 2, 4, 2, 16


def _qkv(seed, t):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(B, t, h, D)), jnp.float32)
                 for h in (HQ, HKV, HKV))


@functools.partial(jax.jit, static_argnames="window")
def _jitted(cache, state, q, k, v, start, n_new, window):
    return cache.update_and_attend(state, q, k, v, start=start, n_new=n_new, window=window)


def _run(cache, state, q, k, v, start, n_new, window=None):
    """One jitted update (compiled once per cache config and shapes)."""
    return _jitted(cache, state, q, k, v, jnp.asarray(start, jnp.int32),
                   jnp.asarray(n_new, jnp.int32), window)


def _dense(q, k, v, start, n_new, max_len):
    d = DenseKVCache()
    return d.update_and_attend(d.init(B, max_len, HKV, D), q, k, v, start=start, n_new=n_new,
                               window=None)[0]


def _rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_unpack_roundtrip(bits):
    x = jnp.asarray(np.random.default_rng(bits).integers(0, 2 ** bits, (3, 5, 16)), jnp.uint8)
    packed = pack_bits(x, bits)
    assert packed.shape == (3, 5, 16 * bits // 8) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(unpack_bits(packed, bits), x)
    with pytest.raises(ValueError, match="bits"):
        pack_bits(x, 3)


def test_uniform_quantization_error_bound():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 32, 8)), jnp.float32)
    codes, scale, zero = quantize_uniform(x, 2, axes=(1,))
    err = jnp.abs(dequantize_uniform(codes, scale, zero) - x)
    assert bool(jnp.all(err <= scale.astype(jnp.float32) / 2 + 1e-2))


def test_int8_close_to_dense_and_bytes():
    q, k, v = _qkv(0, 6)
    start, n_new = jnp.zeros(B, int), jnp.array([6, 4])
    out, st = _run(DenseKVCache(Int8Codec()), DenseKVCache(Int8Codec()).init(B, 8, HKV, D), q, k, v, start, n_new)
    assert _rel(out, _dense(q, k, v, start, n_new, 8)) < 0.02
    assert state_nbytes(st) == B * 8 * HKV * 2 * (D + 2)  # int8 codes + f16 scale, K and V


def _chunked(cache, q, k, v, prefill, max_len):
    """One prefill of `prefill` tokens, then single-token decode steps."""
    t = q.shape[1]
    st = cache.init(B, max_len, HKV, D)
    outs = []
    o, st = _run(cache, st, q[:, :prefill], k[:, :prefill], v[:, :prefill], jnp.zeros(B, int),
                 jnp.full((B,), prefill))
    outs.append(o)
    for i in range(prefill, t):
        o, st = _run(cache, st, q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1],
                     jnp.full((B,), i), jnp.ones(B, int))
        outs.append(o)
    return jnp.concatenate(outs, 1), st


def test_kivi_decode_equals_prefill_and_is_accurate_at_4_bits():
    cache = DenseKVCache(KIVICodec(bits=4, key_group=4, value_group=8, residual=4))
    t = 14
    q, k, v = _qkv(1, t)
    whole, st_whole = _run(cache, cache.init(B, 16, HKV, D), q, k, v, jnp.zeros(B, int),
                           jnp.full((B,), t))
    chunked, st = _chunked(cache, q, k, v, 5, 16)
    np.testing.assert_allclose(chunked, whole, rtol=1e-4, atol=1e-4)
    for name in ("k_codes", "k_stats", "v_codes"):  # complete groups: the same records
        np.testing.assert_array_equal(st[name][:, :12], st_whole[name][:, :12])
    assert _rel(whole, _dense(q, k, v, jnp.zeros(B, int), jnp.full((B,), t), 16)) < 0.1


def test_kivi_residual_window_is_full_precision():
    """With residual >= context every read is from the (bf16) full-precision ring."""
    cache = DenseKVCache(KIVICodec(bits=2, key_group=4, value_group=8, residual=16))
    q, k, v = _qkv(2, 9)
    start, n_new = jnp.zeros(B, int), jnp.array([9, 7])
    out, _ = _run(cache, cache.init(B, 12, HKV, D), q, k, v, start, n_new)
    bf = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    np.testing.assert_allclose(out, _dense(q, bf(k), bf(v), start, n_new, 12), rtol=1e-5,
                               atol=1e-5)


def test_kivi_reads_old_positions_from_per_channel_codes():
    """Past the residual, keys come back from per-channel group codes: the stored stats
    are each group's per-channel min/max and every dequantised key is within half a step."""
    codec = KIVICodec(bits=2, key_group=4, value_group=8, residual=4)
    cache = DenseKVCache(codec)
    q, k, v = _qkv(4, 12)
    _, st = _run(cache, cache.init(B, 12, HKV, D), q, k, v, jnp.zeros(B, int),
                 jnp.full((B,), 12))
    keys, _ = codec.decode({n: st[n] for n in codec.record_spec(HKV, D)}, None)
    kb = k.astype(jnp.bfloat16).astype(jnp.float32).reshape(B, 3, 4, HKV, D)
    lo, hi = kb.min(axis=2), kb.max(axis=2)
    step = ((hi - lo).astype(jnp.float16).astype(jnp.float32) / 3)[:, :, None]
    err = jnp.abs(keys.reshape(B, 3, 4, HKV, D) - kb)
    assert bool(jnp.all(err <= step / 2 + 2e-3 * (1 + jnp.abs(kb))))
    # a channel with one outlier token keeps the other channels' resolution
    assert float(jnp.mean(err)) < float(jnp.mean(step))


def test_kivi_rollback_deeper_than_its_ring_is_nan_not_wrong():
    codec = KIVICodec(bits=2, key_group=2, value_group=8, residual=2, rollback=2)
    cache = DenseKVCache(codec)
    q, k, v = _qkv(5, 12)
    run = lambda st, a, n: _run(cache, st, q[:, a:a + n], k[:, a:a + n], v[:, a:a + n],  # noqa
                                jnp.full((B,), a), jnp.full((B,), n))
    _, st = run(cache.init(B, 12, HKV, D), 0, 10)
    ok, _ = run(st, 8, 1)     # rollback of 2 (within `rollback`): exact
    again, _ = run(cache.init(B, 12, HKV, D), 0, 9)
    np.testing.assert_allclose(ok, again[:, -1:], rtol=1e-5, atol=1e-5)
    deep, _ = run(st, 5, 1)   # rollback of 5: the ring no longer holds position 4
    assert bool(jnp.all(jnp.isnan(deep)))


def test_kivi_bad_config():
    with pytest.raises(ValueError, match="residual"):
        KIVICodec(key_group=32, residual=16)
    with pytest.raises(ValueError, match="bits"):
        KIVICodec(bits=3)
    with pytest.raises(ValueError, match="value_group"):
        DenseKVCache(KIVICodec(value_group=5)).init(1, 8, 1, 16)
    with pytest.raises(ValueError, match="rollback"):
        KIVICodec(rollback=-1)
    with pytest.raises(TypeError, match="write"):
        KIVICodec().encode(*_qkv(0, 2)[1:], jnp.zeros((B, 2), int))


def test_sign_score_estimator_is_unbiased():
    """Averaged over projections, the QJL score estimate converges to q.k."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(D,)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(D,)), jnp.float32)
    proj = jax.random.normal(jax.random.key(0), (4000, D, D))
    est = (np.sqrt(np.pi / 2) / D * jnp.linalg.norm(k)
           * jnp.einsum("d,ndm,nm->n", q, proj, jnp.sign(jnp.einsum("d,ndm->nm", k, proj))))
    assert abs(float(est.mean()) - float(q @ k)) < 4 * float(est.std()) / np.sqrt(4000)


def test_sign_cache_bytes_and_finite_output():
    cache = DenseKVCache(SignCodec(gaussian_projection(jax.random.key(1), HKV, D)))
    q, k, v = _qkv(4, 5)
    out, st = _run(cache, cache.init(B, 8, HKV, D), q, k, v, jnp.zeros(B, int),
                   jnp.full((B,), 5))
    assert bool(jnp.all(jnp.isfinite(out)))
    assert state_nbytes(st) == B * 8 * HKV * 2 * (D // 8 + 2)  # 1 bit/ch + f16 per token
    with pytest.raises(ValueError, match="projection"):
        cache.init(B, 8, HKV + 1, D)


def test_cq_unrotates_keys_and_matches_dense_on_decoded():
    """CQ codes pre-RoPE keys: with a codebook that contains every key exactly, attention
    equals dense attention on the original (post-RoPE) keys."""
    t, theta = 5, 10000.0
    q, k, v = _qkv(5, t)
    pos = jnp.broadcast_to(jnp.arange(t)[None], (B, t))
    k_pre = apply_rope(k, -pos, theta)  # keys as the model had them before RoPE
    g = 2  # channels per code
    # codebook per head and group = that head's pre-RoPE values (B * t = 10 entries)
    kcb = k_pre.reshape(B * t, HKV, D // g, g).transpose(1, 2, 0, 3)
    vcb = v.reshape(B * t, HKV, D // g, g).transpose(1, 2, 0, 3)
    cache = DenseKVCache(CQCodec(kcb, vcb, rope_theta=theta))
    start, n_new = jnp.zeros(B, int), jnp.full((B,), t)
    out, _ = _run(cache, cache.init(B, t, HKV, D), q, k, v, start, n_new)
    np.testing.assert_allclose(out, _dense(q, k, v, start, n_new, t), rtol=1e-4, atol=1e-4)


def test_cq_with_channel_permutations_matches_dense_on_decoded():
    """TaSQ's pre-RoPE mode: groups are runs of permuted channels (pairs may be split)."""
    t, theta, g = 5, 10000.0, 2
    q, k, v = _qkv(6, t)
    pos = jnp.broadcast_to(jnp.arange(t)[None], (B, t))
    k_pre = apply_rope(k, -pos, theta)
    rng = np.random.default_rng(0)
    kp = jnp.asarray(np.stack([rng.permutation(D) for _ in range(HKV)]), jnp.int32)
    vp = jnp.asarray(np.stack([rng.permutation(D) for _ in range(HKV)]), jnp.int32)
    book = lambda x, p: permute_channels(x, p).reshape(B * t, HKV, D // g, g).transpose(  # noqa
        1, 2, 0, 3)
    cache = DenseKVCache(CQCodec(book(k_pre, kp), book(v, vp), rope_theta=theta,
                                 key_perm=kp, value_perm=vp, label="tasq"))
    start, n_new = jnp.zeros(B, int), jnp.full((B,), t)
    out, _ = _run(cache, cache.init(B, t, HKV, D), q, k, v, start, n_new)
    np.testing.assert_allclose(out, _dense(q, k, v, start, n_new, t), rtol=1e-4, atol=1e-4)
    assert cache.codec.describe().startswith("tasq[pre-RoPE keys")
    k_bad, st = k.at[0, 1, 0, 0].set(jnp.nan), cache.init(B, t, HKV, D)
    with pytest.raises(ValueError, match="k contains NaN"):  # eager: checked now
        cache.update_and_attend(st, q, k_bad, v, start=start, n_new=n_new, window=None)
    out, _ = _run(cache, st, q, k_bad, v, start, n_new)  # under jit: the row is poisoned
    assert bool(jnp.isnan(out[0]).all()) and bool(jnp.isfinite(out[1]).all())


def _random_cq(seed, **static):
    rng = np.random.default_rng(seed)
    g, k = 4, 16
    book = lambda: jnp.asarray(rng.normal(size=(HKV, D // g, k, g)), jnp.float32)  # noqa
    perm = lambda: jnp.asarray(np.stack([rng.permutation(D) for _ in range(HKV)]))  # noqa
    return DenseKVCache(CQCodec(book(), book(), key_perm=perm(), value_perm=perm(), **static))


def test_cq_block_size_and_pallas_decode_do_not_change_outputs():
    """The read path rebuilds one block of keys at a time: 3-token blocks give the same
    prefill as one block; the Pallas decode kernel (interpret) equals the XLA path."""
    q, k, v = _qkv(9, 7)
    start, n_new = jnp.zeros(B, int), jnp.array([7, 5])
    big, small = _random_cq(1), _random_cq(1, block=3)
    out_big, st = _run(big, big.init(B, 12, HKV, D), q, k, v, start, n_new)
    out_small, _ = _run(small, small.init(B, 12, HKV, D), q, k, v, start, n_new)
    np.testing.assert_allclose(out_small, out_big, rtol=1e-5, atol=1e-5)
    pallas = _random_cq(1, implementation="pallas", interpret=True)
    q1, k1, v1 = _qkv(10, 1)
    a, sa = _run(big, st, q1, k1, v1, n_new, jnp.ones(B, int))
    b, sb = _run(pallas, st, q1, k1, v1, n_new, jnp.ones(B, int))
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(sa["k_codes"], sb["k_codes"])
    with pytest.raises(ValueError, match="implementation"):
        _random_cq(1, implementation="cuda")
