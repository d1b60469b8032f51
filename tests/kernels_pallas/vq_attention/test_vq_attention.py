"""vq_attention: reference vs a dense oracle, Pallas (interpret) vs reference, lowering."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.vq_attention import (BlockSizes, dequantize, vq_attention_reference,
                                         vq_decode_attention)
from kernels_pallas.vq_attention.kernel import vq_decode_attention_pallas
from research.core.attention import attend


def _inputs(seed, b, hkv, gq, n_groups, gs, s, n_codes=16, shared=False):
    rng = np.random.default_rng(seed)
    d = n_groups * gs
    hc = 1 if shared else hkv
    return dict(
        q=jnp.asarray(rng.normal(size=(b, hkv * gq, d)), jnp.float32),
        k_codes=jnp.asarray(rng.integers(0, n_codes, (b, s, hkv, n_groups)), jnp.uint8),
        v_codes=jnp.asarray(rng.integers(0, n_codes, (b, s, hkv, n_groups)), jnp.uint8),
        k_codebook=jnp.asarray(rng.normal(size=(hc, n_groups, n_codes, gs)), jnp.float32),
        v_codebook=jnp.asarray(rng.normal(size=(hc, n_groups, n_codes, gs)), jnp.float32),
        lengths=jnp.asarray(rng.integers(1, s + 1, (b,)), jnp.int32))


def _dense_oracle(x):
    """Rebuild dense K/V from the codes and run the core attention reference."""
    keys, vals = dequantize(x["k_codes"], x["k_codebook"]), dequantize(x["v_codes"],
                                                                        x["v_codebook"])
    b, s = keys.shape[:2]
    kv_pos = jnp.broadcast_to(jnp.arange(s)[None], (b, s))
    q_pos = jnp.full((b, 1), s)
    return attend(x["q"][:, None], keys, vals, q_pos, kv_pos,
                  kv_pos < x["lengths"][:, None])[:, 0]


@pytest.mark.parametrize("hkv,gq,n_groups,gs,n_codes,shared", [(3, 3, 8, 8, 256, True),
                                                               (2, 4, 4, 4, 16, False)])
def test_reference_matches_dense_attention(hkv, gq, n_groups, gs, n_codes, shared):
    x = _inputs(0, 2, hkv, gq, n_groups, gs, 77, n_codes=n_codes, shared=shared)
    out = jax.jit(vq_decode_attention)(**x)
    np.testing.assert_allclose(out, jax.jit(_dense_oracle)(x), rtol=2e-5, atol=2e-5)


def test_reference_general_mask_matches_dense():
    rng = np.random.default_rng(1)
    x = _inputs(1, 2, 2, 2, 4, 4, 33)
    q = jnp.asarray(rng.normal(size=(2, 3, 4, 16)), jnp.float32)
    mask = jnp.asarray(rng.random((2, 3, 33)) < 0.6).at[1, 2].set(False)  # one empty row
    out = jax.jit(vq_attention_reference)(q, x["k_codes"], x["v_codes"], x["k_codebook"],
                                          x["v_codebook"], mask)
    keys, vals = dequantize(x["k_codes"], x["k_codebook"]), dequantize(x["v_codes"],
                                                                        x["v_codebook"])
    # an arbitrary [B, T, S] mask = per-query kv_valid with every position causal
    kv_pos = jnp.broadcast_to(jnp.arange(33)[None], (2, 33))
    ref = jax.vmap(lambda qt, mt: attend(qt[:, None], keys, vals, jnp.full((2, 1), 33), kv_pos,
                                         mt)[:, 0], in_axes=(1, 1), out_axes=1)(q, mask)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    assert float(jnp.abs(out[1, 2]).max()) == 0.0


# (batch, Hkv, q per kv, groups, group size, context, block_kv, blocks_per_split, shared)
# (batch, Hkv, q per kv, groups, group size, centroids, context, block_kv, blocks/split,
#  shared codebook)
KERNEL_CASES = [
    (2, 3, 3, 8, 8, 256, 200, 64, 2, True),  # SmolLM2 1-bit layout, tail not a block multiple
    (1, 2, 4, 4, 4, 16, 97, 32, 1, False),   # GQA 4, per-head codebooks, 1 token of tail
    (3, 1, 1, 2, 8, 16, 50, 16, 4, False),   # MHA, context shorter than one split
]


# the two kernel bodies: pointer gathers (Triton) and one-hot matmuls (Mosaic)
BACKENDS = ["triton", "mosaic_tpu"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_pallas_interpret_matches_reference(case, backend):
    b, hkv, gq, g, gs, n_codes, s, bkv, bps, shared = case
    x = _inputs(sum(case), b, hkv, gq, g, gs, s, n_codes=n_codes, shared=shared)
    ref = vq_decode_attention(**x)
    out = vq_decode_attention(**x, implementation="pallas", interpret=True, backend=backend,
                              block_sizes=BlockSizes(block_kv=bkv, blocks_per_split=bps))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_pallas_head_dim_not_a_power_of_two():
    """D = 3 groups x 8 = 24 (interpret mode): channels padded to 32 and dropped again."""
    x = _inputs(11, 2, 2, 3, 3, 8, 90, n_codes=256)
    out = vq_decode_attention(**x, implementation="pallas", interpret=True,
                              block_sizes=BlockSizes(block_kv=32, blocks_per_split=2))
    np.testing.assert_allclose(out, vq_decode_attention(**x), rtol=1e-5, atol=1e-5)


def test_default_precision_stays_close():
    """precision="default" (TF32 on GPU; exact f32 on CPU) is a valid, close fast path."""
    x = _inputs(12, 2, 3, 3, 8, 8, 200, n_codes=256, shared=True)
    out = vq_decode_attention(**x, implementation="pallas", interpret=True,
                              block_sizes=BlockSizes(64, 2, precision="default"))
    np.testing.assert_allclose(out, vq_decode_attention(**x), rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="precision"):
        BlockSizes(precision="tf32")


@pytest.mark.parametrize("backend", BACKENDS)
def test_pallas_edge_lengths(backend):
    """Length 0 (all masked -> zeros, as the reference), 1, and exactly the context."""
    x = _inputs(5, 3, 1, 2, 2, 4, 64)
    x["lengths"] = jnp.array([0, 1, 64], jnp.int32)
    ref = vq_decode_attention(**x)
    out = vq_decode_attention(**x, implementation="pallas", interpret=True, backend=backend,
                              block_sizes=BlockSizes(block_kv=32, blocks_per_split=1))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(out[0]).max()) == 0.0


def _lower(backend, platform, g=8, gs=8):
    b, hkv, gq, s = 2, 3, 3, 1000
    args = (jax.ShapeDtypeStruct((b, hkv * gq, g * gs), jnp.float32),
            jax.ShapeDtypeStruct((b, s, hkv, g), jnp.uint8),
            jax.ShapeDtypeStruct((b, s, hkv, g), jnp.uint8),
            jax.ShapeDtypeStruct((1, g, 256, gs), jnp.float32),
            jax.ShapeDtypeStruct((1, g, 256, gs), jnp.float32),
            jax.ShapeDtypeStruct((b,), jnp.int32))
    f = functools.partial(vq_decode_attention_pallas, backend=backend,
                          block_sizes=BlockSizes(block_kv=256, blocks_per_split=2))
    return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_lowers_for_tpu_mosaic():
    assert "tpu_custom_call" in _lower("mosaic_tpu", "tpu")


@pytest.mark.parametrize("g,gs", [(8, 8), (16, 4), (4, 4)])  # 1 bit, 2 bits, D=16
def test_lowers_for_cuda_triton(g, gs):
    text = _lower("triton", "cuda", g, gs)
    assert "triton" in text and "tpu_custom_call" not in text


@pytest.mark.parametrize("g,gs", [(3, 8), (2, 4)])  # G not a power of two; head_dim 8
def test_compiled_triton_rejects_shapes_it_cannot_tile(g, gs):
    with pytest.raises(ValueError, match="power-of-two code groups"):
        _lower("triton", "cuda", g, gs)


def test_bad_inputs_raise_clear_errors():
    x = _inputs(0, 1, 2, 2, 4, 4, 16)
    with pytest.raises(TypeError, match="k_codes"):
        vq_decode_attention(**{**x, "k_codes": x["k_codes"].astype(jnp.int32)})
    with pytest.raises(ValueError, match="k_codebook"):
        vq_decode_attention(**{**x, "k_codebook": x["k_codebook"][:, :3]})
    with pytest.raises(TypeError, match="v_codebook"):
        vq_decode_attention(**{**x, "v_codebook": x["v_codebook"].astype(jnp.int32)})
    with pytest.raises(ValueError, match="head_dim"):
        vq_decode_attention(**{**x, "q": x["q"][..., :8]})
    with pytest.raises(ValueError, match="lengths"):
        vq_decode_attention(**{**x, "lengths": x["lengths"][None]})
    with pytest.raises(ValueError, match="implementation"):
        vq_decode_attention(**x, implementation="cuda")
    with pytest.raises(ValueError, match="block_kv"):
        BlockSizes(block_kv=100)


# -- the platform dispatch (implementation="auto", the default) --------------------------
def _default_targets(platform, g=8, gs=8, rope=False):
    from kernels_pallas.dispatch import custom_call_targets
    from kernels_pallas.vq_attention import KeyRope
    b, hkv, gq, s, d = 2, 3, 3, 300, g * gs
    args = [jax.ShapeDtypeStruct((b, hkv * gq, d), jnp.float32),
            jax.ShapeDtypeStruct((b, s, hkv, g), jnp.uint8),
            jax.ShapeDtypeStruct((b, s, hkv, g), jnp.uint8),
            jax.ShapeDtypeStruct((1, g, 256, gs), jnp.float32),
            jax.ShapeDtypeStruct((1, g, 256, gs), jnp.float32),
            jax.ShapeDtypeStruct((b,), jnp.int32)]
    kw = {}
    if rope:
        perm = np.stack([np.random.default_rng(h).permutation(d) for h in range(hkv)])
        kw["key_rope"] = KeyRope.from_permutation(perm, 10000.0)
    fn = jax.jit(lambda *a: vq_decode_attention(*a, **kw))
    return custom_call_targets(fn.trace(*args).lower(lowering_platforms=(platform,)).as_text())


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_default_lowers_to_the_platform_kernel(platform, rope):
    from kernels_pallas.dispatch import has_pallas_call
    assert has_pallas_call(_default_targets(platform, rope=rope), platform)


def test_default_on_cpu_is_xla_and_equals_reference():
    from kernels_pallas.vq_attention import vq_decode_attention_reference
    assert not _default_targets("cpu")
    x = _inputs(31, 3, 2, 3, 4, 4, 70, n_codes=16)
    np.testing.assert_allclose(jax.jit(vq_decode_attention)(**x),
                               vq_decode_attention_reference(**x), rtol=1e-6, atol=1e-6)


def test_default_on_cuda_falls_back_to_xla_for_untileable_shapes():
    from kernels_pallas.dispatch import has_pallas_call
    assert not has_pallas_call(_default_targets("cuda", g=3, gs=8), "cuda")  # G = 3
    assert has_pallas_call(_default_targets("tpu", g=3, gs=8), "tpu")


# -- paged codes: pages [N, P, Hkv, G] read through a block table ------------------------
@pytest.mark.parametrize("pre_rope", [False, True])
def test_paged_codes_reference_equals_dense_codes(pre_rope):
    from kernels_pallas.vq_attention import KeyRope, vq_decode_attention_paged_codes
    rng = np.random.default_rng(41)
    b, hkv, gq, g, gs, page, m, n = 3, 2, 3, 4, 4, 8, 5, 17
    x = _inputs(41, b, hkv, gq, g, gs, m * page, n_codes=16)
    pages_k = jnp.asarray(rng.integers(0, 16, (n, page, hkv, g)), jnp.uint8)
    pages_v = jnp.asarray(rng.integers(0, 16, (n, page, hkv, g)), jnp.uint8)
    table = rng.permutation(n)[:b * m].reshape(b, m).astype(np.int32)
    table[0, 4] = -1  # unmapped, past row 0's length
    lengths = jnp.asarray([4 * page - 3, m * page, 2 * page + 1], jnp.int32)  # ragged
    kw = {}
    if pre_rope:
        perm = np.stack([rng.permutation(g * gs) for _ in range(hkv)])
        kw["key_rope"] = KeyRope.from_permutation(perm, 10000.0)
    got = vq_decode_attention_paged_codes(x["q"], pages_k, pages_v, x["k_codebook"],
                                          x["v_codebook"], jnp.asarray(table), lengths, **kw)
    dense = lambda p: jnp.asarray(  # noqa: E731  row b's pages end to end
        np.asarray(p)[np.maximum(table, 0)].reshape(b, m * page, hkv, g))
    want = vq_decode_attention(x["q"], dense(pages_k), dense(pages_v), x["k_codebook"],
                               x["v_codebook"], lengths, implementation="xla", **kw)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    if not pre_rope:  # an unmapped page inside a row's length is masked, not page 0
        table[1, 2] = -1
        got = vq_decode_attention_paged_codes(x["q"], pages_k, pages_v, x["k_codebook"],
                                              x["v_codebook"], jnp.asarray(table), lengths)
        mask = np.arange(m * page)[None] < np.asarray(lengths)[:, None]
        mask[1, 2 * page:3 * page] = False
        want = vq_attention_reference(x["q"][:, None], dense(pages_k), dense(pages_v),
                                      x["k_codebook"], x["v_codebook"],
                                      jnp.asarray(mask)[:, None])[:, 0]
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="block_table"):
        vq_decode_attention_paged_codes(x["q"], pages_k, pages_v, x["k_codebook"],
                                        x["v_codebook"], jnp.asarray(table[:2]), lengths)
