"""The K-or-V ablation codec (research/kv/exact_part.py): the exact part is bfloat16, the
other is the inner codec's, in every layout and through the model; refusals name the
problem."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.core.attention import attend
from research.eviction import evict
from research.kv.dense import DenseKVCache
from research.kv.exact_part import ExactPartCodec, kv_exact_part
from research.kv.paged import PagedKVCache
from research.kv.quantized import Int4GroupCodec, Int8Codec, int8_kv
from research.model import forward
from research.model.precision import kv_cache_dtype
from research.tasq.kivi import KIVICodec
from research.transforms import calibrate_and_apply

B, HQ, HKV, D = 2, 4, 2, 8


def _qkv(seed, t):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (B, t, HQ, D)), jax.random.normal(ks[1], (B, t, HKV, D)),
            jax.random.normal(ks[2], (B, t, HKV, D)))


def _positions(t):
    return jnp.broadcast_to(jnp.arange(t)[None], (B, t))


@pytest.mark.parametrize("part", ["k", "v"])
@pytest.mark.parametrize("inner", [Int8Codec(), Int4GroupCodec(group=4)], ids=["int8", "int4"])
def test_the_exact_part_is_bf16_and_the_other_the_inner_codecs(inner, part):
    _, k, v = _qkv(1, 6)
    codec = ExactPartCodec(inner, part)
    records = codec.encode(k, v, _positions(6))
    assert records[f"{part}_exact"].dtype == jnp.bfloat16
    k_out, v_out = codec.decode(records, _positions(6))
    k_in, v_in = inner.decode(inner.encode(k, v, _positions(6)), _positions(6))
    exact, coded = (k_out, v_out) if part == "k" else (v_out, k_out)
    want_exact = (k if part == "k" else v).astype(jnp.bfloat16).astype(exact.dtype)
    np.testing.assert_array_equal(np.asarray(exact), np.asarray(want_exact))
    np.testing.assert_array_equal(np.asarray(coded), np.asarray(v_in if part == "k" else k_in))
    # the inner codec's part really is lossy here, so the test tells the two apart
    assert not np.array_equal(np.asarray(exact),
                              np.asarray(k_in if part == "k" else v_in).astype(exact.dtype))


@pytest.mark.parametrize("part", ["k", "v"])
def test_dense_and_paged_layouts_attend_over_the_mixed_kv(part):
    q, k, v = _qkv(2, 12)
    codec = ExactPartCodec(Int8Codec(), part)
    k_ref, v_ref = codec.decode(codec.encode(k, v, _positions(12)), _positions(12))
    want = attend(q, k_ref, v_ref, _positions(12), _positions(12), jnp.ones((B, 12), bool))
    for cache in (DenseKVCache(codec=codec), PagedKVCache(codec=codec, block_size=4)):
        state = cache.init(B, 12, HKV, D)
        outs, start = [], 0
        for n in (5, 1, 6):  # a prefill chunk, a decode step, another chunk
            sl = slice(start, start + n)
            out, state = cache.update_and_attend(
                state, q[:, sl], k[:, sl], v[:, sl], start=jnp.full((B,), start, jnp.int32),
                n_new=jnp.full((B,), n, jnp.int32), window=None)
            outs.append(out)
            start += n
        np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, axis=1)),
                                   np.asarray(want), atol=2e-5, err_msg=cache.describe())


def test_the_model_with_an_exact_part_over_bf16_is_bf16(tiny):
    tokens = jnp.arange(10, dtype=jnp.int32)[None] % tiny.config.vocab_size
    bf16, _ = calibrate_and_apply(kv_cache_dtype("bfloat16"), tiny, None)
    int8, _ = calibrate_and_apply(int8_kv(), tiny, None)

    def logits(m):
        return np.asarray(forward(m, tokens, cache_states=m.init_cache(1, 16)).logits)
    for part in ("k", "v"):
        over_bf16, _ = calibrate_and_apply(kv_exact_part(part), bf16, None)
        np.testing.assert_array_equal(logits(over_bf16), logits(bf16))
        over_int8, _ = calibrate_and_apply(kv_exact_part(part), int8, None)
        assert f"{part}-bf16" in over_int8.tags
        assert all(c.codec.describe().endswith(f"{part.upper()} in bfloat16")
                   for c in over_int8.caches)
        got = logits(over_int8)
        assert not np.array_equal(got, logits(int8)) and np.all(np.isfinite(got))


def test_refusals_name_the_problem(tiny):
    with pytest.raises(ValueError, match="part must be one of"):
        kv_exact_part("kv")
    with pytest.raises(ValueError, match="part must be one of"):
        ExactPartCodec(Int8Codec(), "q")
    with pytest.raises(TypeError, match="inner must be a KVCodec"):
        ExactPartCodec("int8", "k")
    with pytest.raises(ValueError, match="writes its own records"):
        ExactPartCodec(KIVICodec(bits=2, key_group=4, value_group=4, residual=4), "k")
    with pytest.raises(ValueError, match="already has a record named 'k_exact'"):
        ExactPartCodec(ExactPartCodec(Int8Codec(), "k"), "k").record_spec(HKV, D)
    pressed, _ = calibrate_and_apply(evict("snapkv", 0.5), tiny, None)
    with pytest.raises(TypeError, match=r"kv_exact_part would discard layer 0's evict\["):
        calibrate_and_apply(kv_exact_part("v"), pressed, None)
