"""DynaCore's chosen settings through the Pallas quant-matmul kernels (interpret mode, both
backends), on fresh random inputs: the decode set's W4A16 g64 float-zero GPTQ weights
(float16 zero points) through the int4 kernel, and the prefill set's W8A8 SmoothQuant
(its activation scale) through the int8 kernel. `QuantizedLinear.linear` is run as it is,
with its kernel calls sent to implementation="pallas", interpret=True; the plain-JAX
reference (the CPU default) and dense float math are the oracles."""
import functools

import jax.numpy as jnp
import numpy as np
import pytest
import qwix

from kernels_pallas import quant_matmul
from kernels_pallas.quant_matmul import BlockSizes, int4_matmul_reference
from research.dynacore import quant, quantize_weight, w4a16, w8a8
from research.dynacore.calib import InputStats

SMALL = BlockSizes(8, 64, 32)  # several k / n tiles at these sizes


def _stats(x):
    x64 = np.asarray(x, np.float64)
    return InputStats(x64.T @ x64, np.abs(x64).max(0), len(x64))


def _inputs(seed, rows=512, k=256, n=80, outliers=0):
    """Correlated activations of unequal channel sizes (a few outlier channels if asked)
    and a float weight [k, n]."""
    rng = np.random.default_rng(seed)
    mix = rng.normal(size=(k, k)) * 0.3 + np.eye(k)
    x = (rng.normal(size=(rows, k)) @ mix) * rng.uniform(0.2, 3.0, k)
    x[:, rng.choice(k, outliers, replace=False)] *= 40.0
    w = rng.normal(size=(k, n)) * 0.05
    return x.astype(np.float32), w.astype(np.float32)


def _through_kernel(monkeypatch, name, backend):
    """Send quant.py's `name` matmul to the Pallas kernel of `backend` in interpret mode;
    returns the list of calls made (so a test can see the kernel ran)."""
    real = getattr(quant_matmul, name)
    calls = []

    def pallas(*args, implementation, **kw):
        calls.append(implementation)
        return real(*args, implementation="pallas", backend=backend, interpret=True,
                    block_sizes=SMALL, **kw)

    monkeypatch.setattr(quant, name, pallas)
    return calls


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("backend", ["mosaic_tpu", "triton"])
def test_w4a16_float_zero_gptq_runs_through_the_int4_kernel(monkeypatch, backend):
    x, w = _inputs(11)
    ql = quantize_weight(jnp.asarray(w), w4a16(64, zero_point="float", method="gptq"),
                         stats=_stats(x))
    assert ql.zero.dtype == jnp.float16
    zero = np.asarray(ql.zero, np.float32)
    assert (zero != np.round(zero)).mean() > 0.5  # fractional zeros: not an integer grid
    xs = jnp.asarray(x[:13])  # a few decode rows (M not a tile multiple)
    want = ql.linear(xs)  # the CPU default: the plain-JAX reference
    np.testing.assert_allclose(
        want, int4_matmul_reference(xs, ql.qvalue, ql.scale, ql.zero, 64), rtol=1e-6,
        atol=1e-6)
    calls = _through_kernel(monkeypatch, "int4_matmul", backend)
    got = ql.linear(xs)
    assert calls == ["auto"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got, xs @ ql.dequantize(), rtol=1e-4, atol=1e-4)
    assert _rel(got, x[:13] @ w) < 0.15  # 4-bit g64 GPTQ: close to the float layer
    # bf16 activations (scale cast to bf16 by linear, float16 zero as stored)
    xb = xs.astype(jnp.bfloat16)
    got_b = ql.linear(xb)
    assert got_b.dtype == jnp.bfloat16
    monkeypatch.undo()
    assert _rel(got_b, ql.linear(xb)) < 1e-2


@pytest.mark.parametrize("backend", ["mosaic_tpu", "triton"])
def test_w8a8_smoothquant_activation_scale_runs_through_the_int8_kernel(monkeypatch, backend):
    x, w = _inputs(12, k=128, outliers=4)
    stats = _stats(x)
    plain = quantize_weight(jnp.asarray(w), w8a8())
    smooth = quantize_weight(jnp.asarray(w), w8a8(smooth=0.5), stats=stats)
    assert smooth.act_scale is not None and float(jnp.ptp(smooth.act_scale)) > 0
    xs = jnp.asarray(x[:40])
    want_smooth, want_plain = smooth.linear(xs), plain.linear(xs)  # XLA reference
    calls = _through_kernel(monkeypatch, "int8_matmul", backend)
    got_smooth, got_plain = smooth.linear(xs), plain.linear(xs)
    assert calls == ["auto", "auto"]
    np.testing.assert_allclose(got_smooth, want_smooth, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_plain, want_plain, rtol=1e-5, atol=1e-5)
    ref = x[:40] @ w
    # the activation scale reached the kernel's product: smoothing halves the error
    # (the smoothed weights without 1/s on the activations would be off by the factors s)
    assert _rel(got_smooth, ref) < 0.5 * _rel(got_plain, ref), (_rel(got_smooth, ref),
                                                                  _rel(got_plain, ref))
    assert _rel(got_smooth, ref) < 0.02
    unsmoothed = functools.partial(quant_matmul.int8_matmul, implementation="xla")
    codes = qwix.quantize(xs, jnp.int8, channelwise_axes=(0,))
    wrong = unsmoothed(codes.qvalue, codes.scale, smooth.qvalue, smooth.scale)
    assert _rel(wrong, ref) > 10 * _rel(got_smooth, ref)  # what a dropped 1/s would give
