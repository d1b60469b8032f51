"""Pre-RoPE codes: codec-order RoPE, the blockwise reference and the Pallas kernel against a
dense oracle (un-permute, rotate with the model's RoPE, attend); lowering for TPU/CUDA."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.vq_attention import BlockSizes, KeyRope, dequantize, vq_decode_attention
from kernels_pallas.vq_attention.kernel import vq_decode_attention_pallas
from kernels_pallas.vq_attention.reference import vq_decode_attention_reference
from research.core.attention import attend
from research.core.rope import apply_rope

THETA = 10000.0


def _perms(rng, h, d):
    return np.stack([rng.permutation(d) for _ in range(h)]).astype(np.int32)


def _unpermute(x, perm):  # codec order [B, S, H, D] -> model order
    inv = np.argsort(perm, axis=1)
    return jnp.take_along_axis(x, jnp.asarray(inv)[None, None], axis=-1)


def test_rotation_in_codec_order_equals_model_rope():
    rng = np.random.default_rng(0)
    b, s, h, d = 2, 37, 3, 16
    perm = _perms(rng, h, d)
    x = jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.float32)  # codec order
    pos = jnp.arange(s) + 1000
    got = _unpermute(KeyRope.from_permutation(perm, THETA).rotate(x, pos), perm)
    want = apply_rope(_unpermute(x, perm), jnp.broadcast_to(pos, (b, s)), THETA)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_query_terms_give_the_rotated_score():
    rng = np.random.default_rng(1)
    h, r, d, s = 2, 3, 16, 9
    rope = KeyRope.from_permutation(_perms(rng, h, d), THETA)
    q = jnp.asarray(rng.normal(size=(h, r, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, s, h, d)), jnp.float32)
    pos = jnp.arange(s) * 37
    want = jnp.einsum("hrd,shd->hrs", q, rope.rotate(k, pos)[0])
    a, bq = rope.query_terms(q)
    ang = rope.angles(pos)  # [S, H, D]
    got = (jnp.einsum("hrd,shd->hrs", a, k[0] * jnp.cos(ang))
           + jnp.einsum("hrd,shd->hrs", bq, k[0] * jnp.sin(ang)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_cos_sin_tables_equal_per_channel_trig_exactly():
    rope = KeyRope.from_permutation(_perms(np.random.default_rng(2), 3, 64), THETA)
    pos = jnp.arange(300) * 71  # angles up to ~2e4 radians
    cos, sin = rope.cos_sin(pos)
    ang = rope.angles(pos)
    assert cos.shape == sin.shape == (300, 3, 64)
    np.testing.assert_array_equal(cos, jnp.cos(ang))
    np.testing.assert_array_equal(sin, jnp.sin(ang))


def _inputs(seed, b, hkv, gq, n_groups, gs, s, n_codes, shared):
    rng = np.random.default_rng(seed)
    d = n_groups * gs
    hc = 1 if shared else hkv
    perm = _perms(rng, hkv, d)
    return perm, dict(
        q=jnp.asarray(rng.normal(size=(b, hkv * gq, d)), jnp.float32),
        k_codes=jnp.asarray(rng.integers(0, n_codes, (b, s, hkv, n_groups)), jnp.uint8),
        v_codes=jnp.asarray(rng.integers(0, n_codes, (b, s, hkv, n_groups)), jnp.uint8),
        k_codebook=jnp.asarray(rng.normal(size=(hc, n_groups, n_codes, gs)), jnp.float32),
        v_codebook=jnp.asarray(rng.normal(size=(hc, n_groups, n_codes, gs)), jnp.float32),
        lengths=jnp.asarray(rng.integers(1, s + 1, (b,)), jnp.int32),
        key_rope=KeyRope.from_permutation(perm, THETA))


def _dense_oracle(perm, x):
    """Model-order dense attention: rebuild, un-permute, rotate with the model's RoPE."""
    gq = x["q"].shape[1] // perm.shape[0]
    q_model = _unpermute(x["q"][:, None], np.repeat(perm, gq, axis=0))
    keys = _unpermute(dequantize(x["k_codes"], x["k_codebook"]), perm)
    vals = dequantize(x["v_codes"], x["v_codebook"])  # values stay in codec order
    b, s = keys.shape[:2]
    kv_pos = jnp.broadcast_to(jnp.arange(s)[None], (b, s))
    keys = apply_rope(keys, kv_pos, THETA)
    return attend(q_model, keys, vals, jnp.full((b, 1), s), kv_pos,
                  kv_pos < x["lengths"][:, None])[:, 0]


# (batch, Hkv, q per kv, groups, group size, centroids, context, block_kv, blocks/split,
#  shared codebook)
CASES = [
    (2, 3, 3, 8, 8, 256, 200, 64, 2, False),  # SmolLM2 1-bit layout, ragged tail
    (1, 2, 4, 4, 4, 16, 97, 32, 1, True),     # GQA 4, shared codebook, 1 token of tail
    (3, 1, 1, 2, 8, 16, 50, 16, 4, False),    # MHA, context shorter than one split
]


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])  # gather / one-hot bodies
@pytest.mark.parametrize("case", CASES)
def test_blockwise_reference_and_kernel_match_dense(case, backend):
    b, hkv, gq, g, gs, n_codes, s, bkv, bps, shared = case
    perm, x = _inputs(sum(case), b, hkv, gq, g, gs, s, n_codes, shared)
    want = jax.jit(functools.partial(_dense_oracle, perm))(x)
    ref = vq_decode_attention(**x)  # xla: the two-pass reader, one block (512 > s)
    np.testing.assert_allclose(ref, want, rtol=2e-5, atol=2e-5)
    args = [x[k] for k in ("q", "k_codes", "v_codes", "k_codebook", "v_codebook", "lengths")]
    for block in (16, 48):  # several blocks, the last one ragged
        ref = vq_decode_attention_reference(*args, key_rope=x["key_rope"], block=block)
        np.testing.assert_allclose(ref, want, rtol=2e-5, atol=2e-5)
    out = vq_decode_attention(**x, implementation="pallas", interpret=True, backend=backend,
                              block_sizes=BlockSizes(block_kv=bkv, blocks_per_split=bps))
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


def test_far_positions_and_small_blocks():
    """Positions past 2**14 (angles of thousands of radians), 2048-token reference blocks
    with a ragged tail: both paths still match the model's RoPE."""
    perm, x = _inputs(7, 1, 2, 2, 4, 4, 20000, 16, False)
    x["lengths"] = jnp.array([19990], jnp.int32)
    want = _dense_oracle(perm, x)
    ref = jax.jit(functools.partial(vq_decode_attention_reference, block=2048))(
        x["q"], x["k_codes"], x["v_codes"], x["k_codebook"], x["v_codebook"], x["lengths"],
        key_rope=x["key_rope"])
    np.testing.assert_allclose(ref, want, rtol=1e-4, atol=1e-4)
    out = vq_decode_attention(**x, implementation="pallas", interpret=True,
                              block_sizes=BlockSizes(block_kv=1024, blocks_per_split=4))
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


def _lower(backend, platform):
    b, hkv, gq, g, gs, s = 2, 3, 3, 8, 8, 1000
    perm = _perms(np.random.default_rng(0), hkv, g * gs)
    args = (jax.ShapeDtypeStruct((b, hkv * gq, g * gs), jnp.float32),
            jax.ShapeDtypeStruct((b, s, hkv, g), jnp.uint8),
            jax.ShapeDtypeStruct((b, s, hkv, g), jnp.uint8),
            jax.ShapeDtypeStruct((hkv, g, 256, gs), jnp.float32),
            jax.ShapeDtypeStruct((hkv, g, 256, gs), jnp.float32),
            jax.ShapeDtypeStruct((b,), jnp.int32),
            jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                         KeyRope.from_permutation(perm, THETA)))
    f = functools.partial(vq_decode_attention_pallas, backend=backend,
                          block_sizes=BlockSizes(block_kv=256, blocks_per_split=2))
    return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_rope_kernel_lowers_for_tpu_mosaic():
    assert "tpu_custom_call" in _lower("mosaic_tpu", "tpu")


def test_rope_kernel_lowers_for_cuda_triton():
    text = _lower("triton", "cuda")
    assert "triton" in text and "tpu_custom_call" not in text


def test_bad_key_rope_raises():
    perm, x = _inputs(0, 1, 2, 2, 4, 4, 16, 16, False)
    with pytest.raises(ValueError, match="key_rope.omega"):
        vq_decode_attention(**{**x, "key_rope": KeyRope.from_permutation(
            np.tile(np.arange(8), (2, 1)), THETA)})
    with pytest.raises(TypeError, match="key_rope"):
        vq_decode_attention(**{**x, "key_rope": perm})
    with pytest.raises(ValueError, match="permutations"):
        KeyRope.from_permutation(np.zeros((2, 16), np.int32), THETA)
