"""Public entry points: quantized matmuls for the two serving phases.

    y = int8_matmul(xq, x_scale, wq, w_scale)              # prefill, W8A8
    y = int4_matmul(x, packed, scale, zero, group_size=64)  # decode, W4A16

implementation "auto" (default): the XLA reference on CPU, the Mosaic kernel on TPU, the
Triton kernel on CUDA, chosen when the program is lowered (kernels_pallas.dispatch);
"xla": the reference everywhere; "pallas": the platform's kernel (`backend` forces
"mosaic_tpu" | "triton", e.g. to interpret either on CPU with interpret=True).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels_pallas import dispatch
from kernels_pallas.quant_matmul import kernel
from kernels_pallas.quant_matmul.reference import (int4_matmul_reference,
                                                   int8_matmul_reference)

IMPLEMENTATIONS = dispatch.IMPLEMENTATIONS
BACKENDS = kernel.BACKENDS
GROUP_SIZES = (32, 64, 128)


def _check_common(implementation, backend):
    dispatch.check_implementation(implementation)
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")
    if backend is not None and implementation != "pallas":
        raise ValueError(f"backend={backend!r} applies to implementation='pallas' only, got "
                         f"implementation={implementation!r}")


def validate_int8(xq, x_scale, wq, w_scale) -> None:
    if xq.ndim != 2 or wq.ndim != 2:
        raise ValueError(f"xq must be [M, K] and wq [K, N], got {xq.shape=} {wq.shape=}")
    if xq.dtype != jnp.int8 or wq.dtype != jnp.int8:
        raise TypeError(f"xq and wq must be int8, got {xq.dtype=} {wq.dtype=}")
    if xq.shape[1] != wq.shape[0]:
        raise ValueError(f"contraction mismatch: {xq.shape=} vs {wq.shape=}")
    if x_scale.shape != (xq.shape[0], 1):
        raise ValueError(f"x_scale must be [M={xq.shape[0]}, 1], got {x_scale.shape=}")
    if w_scale.shape != (1, wq.shape[1]):
        raise ValueError(f"w_scale must be [1, N={wq.shape[1]}], got {w_scale.shape=}")


def validate_int4(x, packed, scale, zero, group_size) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if x.ndim != 2 or packed.ndim != 2:
        raise ValueError(f"x must be [M, K] and packed [K/2, N], got {x.shape=} "
                         f"{packed.shape=}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be floating point (the A16 side), got {x.dtype=}")
    if packed.dtype != jnp.uint8:
        raise TypeError(f"packed must be uint8 (two int4 codes per byte), got "
                        f"{packed.dtype=}")
    k = x.shape[1]
    if k % group_size:
        raise ValueError(f"group_size={group_size} must divide the input dim K={k}")
    if packed.shape[0] * 2 != k:
        raise ValueError(f"packed must be [K/2={k // 2}, N], got {packed.shape=}")
    want = (k // group_size, packed.shape[1])
    if scale.shape != want:
        raise ValueError(f"scale must be [K/G, N]={want}, got {scale.shape=}")
    if zero is not None and zero.shape != want:
        raise ValueError(f"zero must be [K/G, N]={want} or None, got {zero.shape=}")


def int8_matmul(xq: Int[Array, "M K"], x_scale: Float[Array, "M 1"], wq: Int[Array, "K N"],
                w_scale: Float[Array, "1 N"], *, implementation: str = "auto",
                backend: str | None = None, interpret: bool = False,
                block_sizes: kernel.BlockSizes = kernel.BlockSizes()) -> Array:
    """f32 [M, N] = (xq @ wq as int32) * x_scale * w_scale."""
    validate_int8(xq, x_scale, wq, w_scale)
    _check_common(implementation, backend)
    return _int8(xq, x_scale, wq, w_scale, implementation=implementation, backend=backend,
                 interpret=interpret, block_sizes=block_sizes)


@functools.partial(jax.jit, static_argnames=("implementation", "backend", "interpret",
                                             "block_sizes"))
def _int8(xq, x_scale, wq, w_scale, *, implementation, backend, interpret, block_sizes):
    kw = dict(block_sizes=block_sizes, interpret=interpret)
    tpu = functools.partial(kernel.int8_matmul, backend="mosaic_tpu", **kw)
    gpu = functools.partial(kernel.int8_matmul, backend="triton", **kw)
    args = (xq, x_scale, wq, w_scale)
    if backend is not None:
        return (tpu if backend == "mosaic_tpu" else gpu)(*args)
    return dispatch.dispatch(*args, implementation=implementation,
                             xla=int8_matmul_reference, tpu=tpu, cuda=gpu)


def int4_matmul(x: Float[Array, "M K"], packed: Array, scale: Float[Array, "KG N"],
                zero: Array | None, *, group_size: int, implementation: str = "auto",
                backend: str | None = None, interpret: bool = False,
                block_sizes: kernel.BlockSizes = kernel.BlockSizes()) -> Array:
    """[M, N] in x's dtype = x @ dequantize(packed, scale, zero) (reference.py layout);
    zero: uint8 integer zero points, float ones (float16 as DynaCore's float-zero grid
    stores them: fractional, any value; dequantized in f32 inside the kernel), or None
    for symmetric codes (zero point 8)."""
    validate_int4(x, packed, scale, zero, group_size)
    _check_common(implementation, backend)
    return _int4(x, packed, scale, zero, group_size=group_size,
                 implementation=implementation, backend=backend, interpret=interpret,
                 block_sizes=block_sizes)


@functools.partial(jax.jit, static_argnames=("group_size", "implementation", "backend",
                                             "interpret", "block_sizes"))
def _int4(x, packed, scale, zero, *, group_size, implementation, backend, interpret,
          block_sizes):
    kw = dict(group_size=group_size, block_sizes=block_sizes, interpret=interpret)
    tpu = functools.partial(kernel.int4_matmul, backend="mosaic_tpu", **kw)
    gpu = functools.partial(kernel.int4_matmul, backend="triton", **kw)
    xla = functools.partial(int4_matmul_reference, group_size=group_size)
    if zero is None:  # platform_dependent needs array operands: close over the None
        tpu, gpu, xla = (functools.partial(lambda f, *a: f(*a, None), f)
                         for f in (tpu, gpu, xla))
        args = (x, packed, scale)
    else:
        args = (x, packed, scale, zero)
    if backend is not None:
        return (tpu if backend == "mosaic_tpu" else gpu)(*args)
    return dispatch.dispatch(*args, implementation=implementation, xla=xla, tpu=tpu,
                             cuda=gpu)
