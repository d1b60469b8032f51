"""Weight quantization for every linear layer: W8A8, W8A16 and W4A16 (group-wise int4).

    w8a8():            int8 weights, one scale per output channel (absmax); activations
                       quantized per token at run time (dynamic absmax int8); the matmul
                       is int8 x int8 -> int32, then both scales (prefill: compute-bound).
    w8a16():           the same int8 weights; activations stay float, the per-channel
                       scale is applied after the matmul.
    w4a16(g, zp):      int4 codes with one scale (and, with zero points, one 4-bit zero
                       point) per group of g input rows per output column, packed two per
                       byte; activations stay float (decode: memory-bound).

The scales and codes come from qwix (`qwix.quantize`: absmax per channel for int8,
`minmax` (zero points) or `absmax` tiled along the input dim for int4) and the W8A8
activation codes too; the int32 product then runs through
`kernels_pallas.quant_matmul` (XLA on CPU, Pallas on TPU/GPU). A `QuantizedLinear` is a
pytree whose arrays are the stored bytes (int8 codes, packed uint8 nibbles, f32 scales,
uint8 zero points): nothing dequantized is kept.

Why qwix's array-level core (`qwix.quantize`, `QArray`; the tests check the W8A8 matmul
against `qwix.dot_general` on the same QArrays) rather than `qwix.quantize_model`:
DynaCore keeps one weight set per phase (`PhaseWeights`) and runs the products through
its own Pallas kernels. `qwix.quantize_model` does attach to the model through
`research.model.NnxModel`, and its int8 PTQ codes equal `w8a16()`'s (tests/model).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import struct

from kernels_pallas.quant_matmul import GROUP_SIZES, int4_matmul, int8_matmul, pack_int4
from kernels_pallas.quant_matmul import dequantize_int4
from research.model.layers import LinearWeight

SCHEMES = {(8, 8): "w8a8", (8, 16): "w8a16", (4, 16): "w4a16"}


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """weight_bits / act_bits: (8, 8) W8A8, (8, 16) W8A16 or (4, 16) W4A16.
    group_size: input rows per scale for 4-bit weights (32, 64 or 128); None for 8-bit
    (one scale per output channel). zero_point: 4-bit asymmetric codes (min/max per
    group) instead of symmetric (absmax). implementation: the matmul's platform dispatch
    ("auto" | "xla" | "pallas", kernels_pallas.dispatch)."""

    weight_bits: int = 8
    act_bits: int = 8
    group_size: int | None = None
    zero_point: bool = True
    implementation: str = "auto"

    def __post_init__(self):
        if (self.weight_bits, self.act_bits) not in SCHEMES:
            raise ValueError(f"unsupported bit widths weight_bits={self.weight_bits!r}, "
                             f"act_bits={self.act_bits!r}: expected one of "
                             f"{sorted(SCHEMES)} (W8A8, W8A16, W4A16)")
        if self.weight_bits == 4 and self.group_size not in GROUP_SIZES:
            raise ValueError(f"unsupported group_size={self.group_size!r} for 4-bit weights:"
                             f" expected one of {GROUP_SIZES}")
        if self.weight_bits == 8 and self.group_size is not None:
            raise ValueError(f"group_size={self.group_size!r}: 8-bit weights have one scale "
                             "per output channel, pass group_size=None")

    @property
    def scheme(self) -> str:
        return SCHEMES[(self.weight_bits, self.act_bits)]

    @property
    def name(self) -> str:
        if self.weight_bits == 4:
            return f"W4A16 g{self.group_size}" + ("" if self.zero_point else " sym")
        return self.scheme.upper()


def w8a8(**kw) -> QuantConfig:
    return QuantConfig(8, 8, None, **kw)


def w8a16(**kw) -> QuantConfig:
    return QuantConfig(8, 16, None, **kw)


def w4a16(group_size: int = 64, zero_point: bool = True, **kw) -> QuantConfig:
    return QuantConfig(4, 16, group_size, zero_point, **kw)


@struct.dataclass
class QuantizedLinear(LinearWeight):
    """One quantized [K, N] weight; `linear(x)` is the layer's matmul (module docstring).

    qvalue: int8 [K, N] (8-bit) or uint8 [K/2, N] packed nibbles (4-bit);
    scale: f32 [1, N] (8-bit) or [K/G, N]; zero: uint8 [K/G, N] 4-bit zero points or None.
    """

    qvalue: jax.Array
    scale: jax.Array
    zero: jax.Array | None
    config: QuantConfig = struct.field(pytree_node=False)
    shape: tuple = struct.field(pytree_node=False)  # (K, N) of the float weight

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in jax.tree.leaves(self))

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float [K, N] weight these codes stand for (for tests and error analysis)."""
        if self.config.weight_bits == 4:
            return dequantize_int4(self.qvalue, self.scale, self.zero,
                                   self.config.group_size, dtype)
        return (self.qvalue.astype(jnp.float32) * self.scale).astype(dtype)

    def linear(self, x: jax.Array) -> jax.Array:
        k, n = self.shape
        if x.shape[-1] != k:
            raise ValueError(f"quantized weight expects inputs [..., {k}], got {x.shape=}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        impl = self.config.implementation
        scheme = self.config.scheme
        if scheme == "w8a8":
            xa = qwix.quantize(x2.astype(jnp.float32), jnp.int8, channelwise_axes=(0,))
            y = int8_matmul(xa.qvalue, xa.scale, self.qvalue, self.scale,
                            implementation=impl)
        elif scheme == "w8a16":
            y = jnp.dot(x2, self.qvalue.astype(x2.dtype),
                        preferred_element_type=jnp.float32) * self.scale
        else:
            y = int4_matmul(x2, self.qvalue, self.scale.astype(x2.dtype), self.zero,
                            group_size=self.config.group_size, implementation=impl)
        return y.astype(x.dtype).reshape(*lead, n)


def quantize_weight(w: jax.Array, config: QuantConfig, name: str = "weight"
                    ) -> QuantizedLinear:
    """Quantize one float [K, N] weight (K inputs, N outputs); `name` labels errors."""
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a QuantConfig, got {type(config).__name__}")
    if w.ndim != 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"{name}: expected a float [in, out] weight, got {w.shape=} "
                         f"{w.dtype=}")
    k, n = w.shape
    if config.weight_bits == 4 and k % config.group_size:
        raise ValueError(f"{name}: group_size={config.group_size} does not divide the input "
                         f"dim {k} of its [{k}, {n}] weight")
    qvalue, scale, zero, finite = _quantize_arrays(jnp.asarray(w), config.weight_bits,
                                                   config.group_size, config.zero_point)
    if not bool(finite):
        raise ValueError(f"{name}: non-finite values (NaN/inf) in the float weight: "
                         "refusing to quantize (its scales would be NaN)")
    check_finite_scale(scale, name)
    return QuantizedLinear(qvalue, scale, zero, config, (k, n))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize_arrays(w, bits: int, group_size: int | None, zero_point: bool):
    """(codes, f32 scale, zero or None, all-finite flag) of a float [K, N] weight, via qwix."""
    w32 = w.astype(jnp.float32)
    finite = jnp.isfinite(w32).all()
    if bits == 8:
        qa = qwix.quantize(w32, jnp.int8, channelwise_axes=(1,))
        return qa.qvalue, qa.scale.reshape(1, -1), None, finite
    method = "minmax" if zero_point else "absmax"
    qa = qwix.quantize(w32, jnp.int4, channelwise_axes=(1,), tiled_axes={0: group_size},
                       calibration_method=method)
    codes = (qa.qvalue.astype(jnp.int32) + 8).astype(jnp.uint8)  # -8..7 -> 0..15
    zero = None
    if zero_point:
        zero = (qa.zero_point.astype(jnp.int32) + 8).astype(jnp.uint8)
    return pack_int4(codes, group_size), qa.scale.astype(jnp.float32), zero, finite


def check_finite_scale(scale, name: str) -> None:
    """A NaN/inf scale (NaN weights, a damaged checkpoint) is an error naming the weight."""
    s = np.asarray(scale)
    if not np.isfinite(s).all():
        bad = np.argwhere(~np.isfinite(s))[0].tolist()
        raise ValueError(f"{name}: non-finite quantization scale at index {bad} "
                         f"({int((~np.isfinite(s)).sum())} of {s.size}); the float weight "
                         "has NaN/inf or the quantized state is damaged")
