"""Quantized matmul kernels: packing, the references against qwix and dense math, the
Pallas kernels (interpret mode, both backends) on fresh random inputs, lowering for TPU
(Mosaic) and CUDA (Triton), the CPU default (XLA), and input errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

from kernels_pallas.dispatch import custom_call_targets, has_pallas_call
from kernels_pallas.quant_matmul import (BlockSizes, dequantize_int4, int4_matmul,
                                         int4_matmul_reference, int8_matmul,
                                         int8_matmul_reference, pack_int4, unpack_int4)

SMALL = BlockSizes(8, 64, 32)


def _int8_inputs(seed, m, k, n):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.integers(-127, 128, (m, k)), jnp.int8),
            jnp.asarray(rng.uniform(0.01, 0.1, (m, 1)), jnp.float32),
            jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8),
            jnp.asarray(rng.uniform(0.01, 0.1, (1, n)), jnp.float32))


def _int4_inputs(seed, m, k, n, g, zero=True):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    u = jnp.asarray(rng.integers(0, 16, (k, n)), jnp.uint8)
    s = jnp.asarray(rng.uniform(0.01, 0.1, (k // g, n)), jnp.float32)
    if zero == "f16":  # the float-zero grid's (DynaCore's W4A16 default): fractional, and
        # past the code range at either end (a group that does not straddle 0)
        z = jnp.asarray(rng.uniform(-3.0, 19.0, (k // g, n)), jnp.float16)
    else:
        z = jnp.asarray(rng.integers(0, 16, (k // g, n)), jnp.uint8) if zero else None
    return x, u, s, z


@pytest.mark.parametrize("g", [32, 64, 128])
def test_pack_roundtrip_and_dequantize_match_dense_math(g):
    x, u, s, z = _int4_inputs(g, 3, 2 * g, 24, g)
    p = pack_int4(u, g)
    assert p.shape == (g, 24) and p.dtype == jnp.uint8
    np.testing.assert_array_equal(unpack_int4(p, g), u)
    rows = np.arange(2 * g) // g
    want = (np.asarray(u, np.float32) - np.asarray(z, np.float32)[rows]) * np.asarray(s)[rows]
    np.testing.assert_allclose(dequantize_int4(p, s, z, g), want, rtol=1e-6)
    np.testing.assert_allclose(int4_matmul_reference(x, p, s, z, g), np.asarray(x) @ want,
                               rtol=1e-4, atol=1e-4)


def test_int8_reference_matches_qwix_dot_general():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(6, 96)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(96, 40)), jnp.float32)
    xa = qwix.quantize(x, jnp.int8, channelwise_axes=(0,))
    wa = qwix.quantize(w, jnp.int8, channelwise_axes=(1,))
    want = qwix.dot_general(xa, wa, (((1,), (0,)), ((), ())))
    got = int8_matmul_reference(xa.qvalue, xa.scale, wa.qvalue, wa.scale)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    rel = float(jnp.linalg.norm(got - x @ w) / jnp.linalg.norm(x @ w))
    assert 1e-4 < rel < 0.02, rel  # int8 rounding error: present, small


@pytest.mark.parametrize("backend", ["mosaic_tpu", "triton"])
@pytest.mark.parametrize("seed", range(2))
def test_int8_kernel_interpret_matches_reference(backend, seed):
    m, k, n = [int(v) for v in np.random.default_rng(seed).integers(1, 5, 3) * (7, 64, 24)]
    args = _int8_inputs(seed, m, k, n)
    got = int8_matmul(*args, implementation="pallas", backend=backend, interpret=True,
                      block_sizes=SMALL)
    np.testing.assert_allclose(got, int8_matmul_reference(*args), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("backend", ["mosaic_tpu", "triton"])
@pytest.mark.parametrize("g,zero", [(32, True), (64, True), (64, False), (128, True),
                                    (32, "f16"), (64, "f16")])
def test_int4_kernel_interpret_matches_reference(backend, g, zero):
    x, u, s, z = _int4_inputs(g, 5, 4 * g, 40, g, zero)
    p = pack_int4(u, g)
    got = int4_matmul(x, p, s, z, group_size=g, implementation="pallas", backend=backend,
                      interpret=True, block_sizes=SMALL)
    want = int4_matmul_reference(x, p, s, z, g)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    if zero == "f16":  # the fractional part of the zeros is used, not rounded away
        rounded = int4_matmul_reference(x, p, s, jnp.round(z), g)
        assert float(jnp.abs(got - rounded).max()) > 100 * 1e-4


@pytest.mark.parametrize("backend", ["mosaic_tpu", "triton"])
def test_int4_kernel_float16_zero_with_bf16_activations(backend):
    """DynaCore's decode call under bf16: bf16 x and scale (linear casts the scale to x's
    dtype), float16 zero points as stored."""
    x, u, s, z = _int4_inputs(7, 9, 256, 48, 64, "f16")
    x, s, p = x.astype(jnp.bfloat16), s.astype(jnp.bfloat16), pack_int4(u, 64)
    got = int4_matmul(x, p, s, z, group_size=64, implementation="pallas", backend=backend,
                      interpret=True, block_sizes=SMALL)
    assert got.dtype == jnp.bfloat16
    want = int4_matmul_reference(x.astype(jnp.float32), p, s.astype(jnp.float32), z, 64)
    err = float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))
    assert err < 1e-2, err  # bf16 weights tile and output rounding only


def _targets(fn, args, platform):
    return custom_call_targets(jax.jit(fn).trace(*args).lower(
        lowering_platforms=(platform,)).as_text())


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_kernels_lower_for_tpu_and_cuda_and_cpu_default_is_xla(platform):
    i8 = (jax.ShapeDtypeStruct((64, 1024), jnp.int8), jax.ShapeDtypeStruct((64, 1), jnp.float32),
          jax.ShapeDtypeStruct((1024, 512), jnp.int8), jax.ShapeDtypeStruct((1, 512), jnp.float32))
    assert has_pallas_call(_targets(int8_matmul, i8, platform), platform)
    assert not has_pallas_call(_targets(int8_matmul, i8, "cpu"), "cuda")
    for g in (32, 128):
        for zero in (jnp.uint8, jnp.float16, None):  # integer, float (DynaCore's), none
            i4 = (jax.ShapeDtypeStruct((8, 2048), jnp.float32),
                  jax.ShapeDtypeStruct((1024, 512), jnp.uint8),
                  jax.ShapeDtypeStruct((2048 // g, 512), jnp.float32),
                  None if zero is None else jax.ShapeDtypeStruct((2048 // g, 512), zero))
            fn = lambda x, p, s, z, g=g: int4_matmul(x, p, s, z, group_size=g)  # noqa: E731
            assert has_pallas_call(_targets(fn, i4, platform), platform), (g, zero)


def test_bad_inputs_are_named_errors():
    x, u, s, z = _int4_inputs(0, 2, 128, 16, 64)
    p = pack_int4(u, 64)
    with pytest.raises(ValueError, match="group_size must be one of"):
        int4_matmul(x, p, s, z, group_size=48)
    with pytest.raises(ValueError, match="must divide the input dim"):
        int4_matmul(x[:, :96], p[:48], s, z, group_size=64)
    with pytest.raises(TypeError, match="packed must be uint8"):
        int4_matmul(x, p.astype(jnp.int8), s, z, group_size=64)
    with pytest.raises(ValueError, match="scale must be"):
        int4_matmul(x, p, s[:1], z, group_size=64)
    xq, xs, wq, ws = _int8_inputs(0, 2, 64, 8)
    with pytest.raises(TypeError, match="must be int8"):
        int8_matmul(xq.astype(jnp.int32), xs, wq, ws)
    with pytest.raises(ValueError, match="contraction mismatch"):
        int8_matmul(xq, xs, wq[:32], ws)
    with pytest.raises(ValueError, match="implementation must be one of"):
        int8_matmul(xq, xs, wq, ws, implementation="cuda")
