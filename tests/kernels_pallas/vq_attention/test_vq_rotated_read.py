"""Pre-RoPE codes read through rotated per-query tables (rotated.py) against the rebuilt-key
reference (decode the codes, un-permute, rotate with the model's RoPE, attend) and against
the existing rebuild readers, dense and paged, at positions up to 8k."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.vq_attention import KeyRope, dequantize
from kernels_pallas.vq_attention.reference import (vq_decode_attention_paged,
                                                   vq_decode_attention_pre_rope)
from kernels_pallas.vq_attention.rotated import (PairTables, pair_aligned, pair_aligned_order,
                                                 vq_attention_rotated,
                                                 vq_decode_attention_rotated,
                                                 vq_decode_attention_rotated_paged)
from research.core.attention import attend
from research.core.rope import apply_rope

THETA = 10000.0


def _aligned_perms(rng, h, d, gs):
    """Random codec orders whose groups of `gs` hold whole RoPE pairs, shuffled inside."""
    rows = []
    for _ in range(h):
        pairs = rng.permutation(d // 2).reshape(-1, gs // 2)
        groups = np.concatenate([pairs, pairs + d // 2], axis=1)
        rows.append(np.stack([rng.permutation(g) for g in groups]).reshape(-1))
    return np.stack(rows).astype(np.int32)


def _case(rng, b, s, hkv, gq, d, gs, k, hc=None):
    g = d // gs
    hc = hkv if hc is None else hc
    perm = _aligned_perms(rng, hkv, d, gs)
    books = [jnp.asarray(rng.normal(size=(hc, g, k, gs)), jnp.float32) for _ in range(2)]
    codes = [jnp.asarray(rng.integers(0, k, (b, s, hkv, g)), jnp.uint8) for _ in range(2)]
    q = jnp.asarray(rng.normal(size=(b, hkv * gq, d)) * 2.0, jnp.float32)  # codec order
    return perm, books, codes, q


def _to_model(x, perm):  # codec order [B, S, H, D] -> model order (H a multiple of Hkv)
    inv = np.repeat(np.argsort(perm, axis=1), x.shape[2] // perm.shape[0], axis=0)
    return jnp.take_along_axis(x, jnp.asarray(inv)[None, None], axis=-1)


def _oracle(q, perm, books, codes, q_pos, mask):
    """Dense rebuilt keys: decode, un-permute, model RoPE at slot positions, attend."""
    b, s = codes[0].shape[:2]
    k = _to_model(dequantize(codes[0], books[0]), perm)
    v = _to_model(dequantize(codes[1], books[1]), perm)
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    k = apply_rope(k, pos, THETA)
    out = attend(_to_model(q, perm), k, v, q_pos, pos, mask, None)
    return _to_model(out, np.argsort(perm, axis=1))  # back to codec order


def test_shifted_cos_sin_is_angle_addition():
    pairs = PairTables.from_permutation(_aligned_perms(np.random.default_rng(5), 2, 16, 4),
                                        4, THETA)
    local = pairs.cos_sin(jnp.arange(64))
    np.testing.assert_allclose(pairs.shifted(local, 4096), pairs.cos_sin(4096 + jnp.arange(64)),
                               atol=2e-3)
    np.testing.assert_allclose(pairs.shifted(local, 0), local, atol=1e-7)


def test_pair_alignment_helpers():
    order = pair_aligned_order(16, 8)
    assert pair_aligned(order[None], 8) and not pair_aligned(np.arange(16)[None], 8)
    np.testing.assert_array_equal(order[:8], [0, 1, 2, 3, 8, 9, 10, 11])
    with pytest.raises(ValueError, match="whole RoPE pairs"):
        PairTables.from_permutation(np.arange(16)[None], 8, THETA)
    with pytest.raises(ValueError, match="group_size"):
        pair_aligned_order(16, 3)


def test_decode_equals_rebuilt_keys_at_positions_up_to_8k():
    rng = np.random.default_rng(0)
    b, s, hkv, gq, d, gs, k = 2, 8192, 2, 2, 16, 8, 16
    perm, books, codes, q = _case(rng, b, s, hkv, gq, d, gs, k)
    lengths = jnp.asarray([s, 5000])
    pairs = PairTables.from_permutation(perm, gs, THETA)
    got = jax.jit(vq_decode_attention_rotated)(q, *codes, *books, lengths, pairs)
    mask = jnp.arange(s)[None] < lengths[:, None]
    want = _oracle(q[:, None], perm, books, codes, (lengths - 1)[:, None], mask)[:, 0]
    # block-origin angle addition rounds angles as fl(o w) + fl(j w), not fl(p w) (~5e-4
    # rad at 8k for the fastest pair): as far from the oracle as the rebuild reader is
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # the codec's rebuild reader (block-local cos/sin, query rotated per block)
    rebuilt = jax.jit(vq_decode_attention_pre_rope)(q, *codes, *books, lengths,
                                                    KeyRope.from_permutation(perm, THETA))
    np.testing.assert_allclose(got, rebuilt, rtol=2e-5, atol=2e-5)
    print("max |rotated - oracle|", float(jnp.max(jnp.abs(got - want))),
          "max |rebuild - oracle|", float(jnp.max(jnp.abs(rebuilt - want))))


@pytest.mark.parametrize("hc", [1, 3])
def test_query_chunk_with_mask_equals_rebuilt_keys(hc):
    rng = np.random.default_rng(1)
    b, s, t, hkv, gq, d, gs, k = 2, 77, 3, 3, 2, 16, 4, 8
    perm, books, codes, _ = _case(rng, b, s, hkv, gq, d, gs, k, hc=hc)
    q = jnp.asarray(rng.normal(size=(b, t, hkv * gq, d)), jnp.float32)
    q_pos = jnp.asarray([[60, 61, 62], [10, 11, 12]])
    mask = (jnp.arange(s)[None, None] <= q_pos[..., None]) & (
        jnp.arange(s)[None, None] > q_pos[..., None] - 20)  # a window of 20
    read = jax.jit(vq_attention_rotated, static_argnames="block")
    got = read(q, *codes, *books, mask, PairTables.from_permutation(perm, gs, THETA),
               block=16)
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    k_model = apply_rope(_to_model(dequantize(codes[0], books[0]), perm), pos, THETA)
    v_model = _to_model(dequantize(codes[1], books[1]), perm)
    want = attend(_to_model(q, perm), k_model, v_model, q_pos, pos,
                  jnp.ones((b, s), bool), 20)
    np.testing.assert_allclose(_to_model(got, perm), want, rtol=2e-5, atol=2e-5)


def test_paged_decode_equals_the_paged_rebuild_reader():
    rng = np.random.default_rng(2)
    b, hkv, gq, d, gs, k, page, m = 2, 2, 3, 16, 8, 32, 16, 8
    n_pages = 20
    perm, books, pages, q = _case(rng, n_pages, page, hkv, gq, d, gs, k)
    q = q[:b]
    table = jnp.asarray(np.stack([rng.permutation(n_pages)[:m] for _ in range(b)]), jnp.int32)
    table = table.at[1, 6:].set(-1)  # row 1 maps 6 pages, holds 90 tokens
    lengths = jnp.asarray([m * page - 3, 90])
    pairs = PairTables.from_permutation(perm, gs, THETA)
    got = jax.jit(vq_decode_attention_rotated_paged, static_argnames="block")(
        q, *pages, *books, table, lengths, pairs, block=32)
    want = jax.jit(vq_decode_attention_paged)(q, *pages, *books, table, lengths,
                                     key_rope=KeyRope.from_permutation(perm, THETA))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_rotated_read_jits_with_a_traced_permutation():
    rng = np.random.default_rng(3)
    perm, books, codes, q = _case(rng, 1, 40, 2, 2, 16, 8, 16)
    lengths = jnp.asarray([33])

    @jax.jit
    def run(perm):
        return vq_decode_attention_rotated(q, *codes, *books, lengths,
                                           PairTables.from_permutation(perm, 8, THETA))
    want = vq_decode_attention_rotated(q, *codes, *books, lengths,
                                       PairTables.from_permutation(perm, 8, THETA))
    np.testing.assert_allclose(run(jnp.asarray(perm)), want, rtol=1e-6, atol=1e-6)
