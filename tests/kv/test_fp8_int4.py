"""The field's baseline codecs: fp8 e4m3 with static scales (vLLM's kv_cache_dtype=fp8)
and int4 per 32-channel group (llama.cpp's q4_0), against plain references on fresh
random inputs."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels_pallas.paged_attention.api import paged_decode_attention
from research.core.rope import apply_rope
from research.kv.codec import PageRead
from research.kv.fp8 import FP8_MAX, FP8Codec
from research.kv.quantized import Int4GroupCodec, dequantize_q4, quantize_q4
from research.tasq.baselines import fp8_scales, rope_safe_amax


def _kv(seed, b=2, t=5, h=3, d=64, scale=3.0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=(b, t, h, d)) * scale, jnp.float32) for _ in range(2)]


def test_q4_matches_a_plain_numpy_q4_0():
    """Codes and scales as llama.cpp's q4_0 computes them, per 32-channel group."""
    x = np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32) * 2
    packed, d = quantize_q4(jnp.asarray(x))
    got = np.asarray(dequantize_q4(packed, d))
    want = np.empty_like(x)
    for r in range(3):
        for g in range(2):
            blk = x[r, 32 * g:32 * g + 32]
            m = blk[np.argmax(np.abs(blk))]
            dd = np.float32(np.float16(m / -8))
            q = np.clip(np.round(blk / dd) + 8, 0, 15)
            want[r, 32 * g:32 * g + 32] = (q - 8) * dd
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert packed.dtype == jnp.uint8 and packed.shape == (3, 32) and d.shape == (3, 2)
    # the error of a 4-bit code: at most half a step (|d| / 2) per channel
    step = np.repeat(np.abs(np.asarray(d, np.float32)), 32, axis=-1)
    assert np.all(np.abs(got - x) <= step / 2 + 1e-6)


def test_int4_codec_round_trip_and_bytes():
    k, v = _kv(1)
    codec = Int4GroupCodec()
    rec = codec.encode(k, v, None)
    dk, dv = codec.decode(rec, None)
    for got, x in ((dk, k), (dv, v)):
        rel = float(jnp.linalg.norm(got - x) / jnp.linalg.norm(x))
        assert 0.02 < rel < 0.15, rel
    bits = sum(s.dtype.itemsize * np.prod(s.shape) for s in
               codec.record_spec(3, 64).values()) * 8 / (2 * 3 * 64)
    assert bits == 4.5  # q4_0: 4 bits + a float16 scale per 32 channels
    with pytest.raises(ValueError, match="group"):
        Int4GroupCodec().record_spec(3, 48)


def test_fp8_codec_round_trip_saturates_and_checks_scales():
    k, v = _kv(2)
    ks, vs = fp8_scales(np.asarray(k).reshape(-1, 3, 64), np.asarray(v).reshape(-1, 3, 64),
                        per_head=True)
    codec = FP8Codec(jnp.asarray(ks), jnp.asarray(vs))
    rec = codec.encode(k, v, None)
    assert rec["k"].dtype == jnp.float8_e4m3fn
    dk, dv = codec.decode(rec, None)
    for got, x in ((dk, k), (dv, v)):  # e4m3: 3 mantissa bits, <= 2^-4 relative rounding
        np.testing.assert_allclose(np.asarray(got), np.asarray(x), rtol=2 ** -4, atol=1e-3)
    # values past +-448 x scale saturate (vLLM's cast), never NaN
    big = FP8Codec(jnp.full((3,), 1e-3), jnp.full((3,), 1e-3)).encode(k * 100, v, None)
    assert np.all(np.isfinite(np.asarray(big["k"], np.float32)))
    assert float(jnp.max(jnp.abs(big["k"].astype(jnp.float32)))) == FP8_MAX
    with pytest.raises(ValueError, match="k_scale"):
        FP8Codec(jnp.ones(2), jnp.ones(3)).record_spec(3, 64)


def test_per_tensor_scales_are_one_value_per_layer():
    k, v = _kv(3)
    ks, vs = fp8_scales(np.asarray(k[0]), np.asarray(v[0]), per_head=False)
    assert np.all(ks == ks[0]) and np.all(vs == vs[0])
    kh, vh = fp8_scales(np.asarray(k[0]), np.asarray(v[0]), per_head=True)
    assert np.isclose(ks[0], kh.max()) and np.isclose(vs[0], vh.max())


def test_rope_safe_amax_bounds_keys_at_every_position():
    """The key scale is taken over RoPE-pair norms: no rotation, at any position, gives a
    channel beyond it; the largest channel of some rotation reaches it."""
    k_pre = np.random.default_rng(4).normal(size=(6, 2, 64)).astype(np.float32)
    bound = rope_safe_amax(k_pre)
    pos = jnp.asarray(np.arange(0, 8192, 7)[None].repeat(6, 0).T.reshape(1, -1))
    rotated = apply_rope(jnp.asarray(np.tile(k_pre, (pos.shape[1] // 6, 1, 1)))[None],
                         pos[:, :pos.shape[1] // 6 * 6], 10000.0)[0]
    amax = np.abs(np.asarray(rotated)).max(axis=(0, 2))
    assert np.all(amax <= bound * (1 + 1e-5)) and np.all(amax > 0.9 * bound)


def test_fp8_page_reader_equals_the_dense_reference():
    """The paged kernel over fp8 pages with scales folded into q and the output gives the
    attention of the dequantised keys and values (Pallas interpret mode; the kernel
    computes one-byte pages in bf16, so q and the probabilities are rounded to bf16)."""
    rng = np.random.default_rng(5)
    n_blocks, bs, hkv, hq, d, b = 6, 4, 2, 4, 64, 2
    k = jnp.asarray(rng.normal(size=(n_blocks, bs, hkv, d)) * 2, jnp.float32)
    v = jnp.asarray(rng.normal(size=(n_blocks, bs, hkv, d)), jnp.float32)
    codec = FP8Codec(jnp.asarray([0.02, 0.05]), jnp.asarray([0.01, 0.03]))
    pages = codec.encode(k, v, None)
    table = jnp.asarray([[0, 2, 4], [1, 3, 5]], jnp.int32)
    lengths = jnp.asarray([9, 12], jnp.int32)
    q = jnp.asarray(rng.normal(size=(b, hq, d)), jnp.float32)
    reader = codec.page_reader(None, PageRead("pallas", None, True))
    got = reader(q, pages, table, lengths)
    dk, dv = codec.decode(pages, None)
    want = paged_decode_attention(q, dk, dv, table, lengths, implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2)
    err = float(jnp.max(jnp.abs(got - want)))
    assert err < 0.1 * float(jnp.max(jnp.abs(want)))
    assert ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max == FP8_MAX
