"""Weight quantization for every linear layer: W8A8, W8A16 and W4A16 (group-wise int4).

    w8a8(smooth=a):    int8 weights, one scale per output channel (absmax); activations
                       quantized per token at run time (dynamic absmax int8); the matmul
                       is int8 x int8 -> int32, then both scales (prefill: compute-bound).
                       With `smooth`, SmoothQuant (Xiao et al. 2022): per input channel
                       j, s_j = max|x_j|^a / max|W_j|^(1-a) from calibration inputs;
                       the weight rows are multiplied by s before quantizing and the
                       activations by 1/s (stored, `act_scale`) before theirs, moving
                       activation outliers into the weights.
    w8a16():           the same int8 weights; activations stay float, the per-channel
                       scale is applied after the matmul.
    w4a16(g, zp, method):
                       int4 codes with one scale (and a zero point) per group of g input
                       rows per output column, packed two per byte; activations stay float
                       (decode: memory-bound). zero_point "none" (symmetric), "int" (an
                       integer zero, qwix's min/max) or "float" (llama.cpp Q4_1's grid: a
                       float16 zero, so the grid starts at the group minimum). method
                       "rtn" (round to nearest) or "gptq" (gptq.py: rows quantized in turn,
                       errors pushed onto later rows through the calibration Hessian).

The int8 scales and codes come from qwix (`qwix.quantize`), as do the symmetric / integer
int4 grids (qwix `absmax` / `minmax`; GPTQ follows `qwix.contrib.gptq_core`) and the W8A8
activation codes; SmoothQuant's factors are qwix's `smooth_quant.compute_scales_ratio`.
The float-zero grid is this package's (gptq.py says why). The int32 / int4 products run
through `kernels_pallas.quant_matmul` (XLA on CPU, Pallas on TPU/GPU). A `QuantizedLinear`
is a pytree whose arrays are the stored bytes (int8 codes, packed uint8 nibbles, f32
scales, uint8 / float16 zero points, f32 activation factors): nothing dequantized is kept.

The data-aware settings (`smooth`, method "gptq") need calibration inputs
(`calib.input_stats`); `transform.quantize(config).calibrate(model, data)` collects them.

Why qwix's array-level core (`qwix.quantize`, `QArray`; the tests check the W8A8 matmul
against `qwix.dot_general` on the same QArrays) rather than `qwix.quantize_model`:
DynaCore keeps one weight set per phase (`PhaseWeights`) and runs the products through
its own Pallas kernels. `qwix.quantize_model` does attach to the model through
`research.model.NnxModel`, and its int8 PTQ codes equal `w8a16()`'s (tests/model).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from qwix.contrib import smooth_quant
from flax import struct

from kernels_pallas.quant_matmul import GROUP_SIZES, int4_matmul, int8_matmul, pack_int4
from kernels_pallas.quant_matmul import dequantize_int4
from research.dynacore.calib import InputStats
from research.dynacore.gptq import ZERO_POINTS, gptq_quantize, rtn_quantize
from research.model.layers import LinearWeight

SCHEMES = {(8, 8): "w8a8", (8, 16): "w8a16", (4, 16): "w4a16"}
METHODS = ("rtn", "gptq")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """weight_bits / act_bits: (8, 8) W8A8, (8, 16) W8A16 or (4, 16) W4A16.
    group_size: input rows per scale for 4-bit weights (32, 64 or 128); None for 8-bit
    (one scale per output channel). zero_point (4-bit): "none" (symmetric, absmax),
    "int" (integer zero, min/max; True is accepted for it, False for "none") or "float"
    (float16 zero: llama.cpp Q4_1's grid). method (4-bit): "rtn" or "gptq" (needs
    calibration data). smooth (W8A8 only): SmoothQuant's migration strength in (0, 1]
    (needs calibration data), None = off. implementation: the matmul's platform dispatch
    ("auto" | "xla" | "pallas", kernels_pallas.dispatch)."""

    weight_bits: int = 8
    act_bits: int = 8
    group_size: int | None = None
    zero_point: str = "int"
    implementation: str = "auto"
    method: str = "rtn"
    smooth: float | None = None

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
        if isinstance(self.zero_point, bool):  # the earlier bool API: True = integer zeros
            object.__setattr__(self, "zero_point", "int" if self.zero_point else "none")
        if self.zero_point not in ZERO_POINTS:
            raise ValueError(f"zero_point must be one of {ZERO_POINTS} (or a bool), got "
                             f"{self.zero_point!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.method == "gptq" and self.weight_bits != 4:
            raise ValueError("method='gptq' is for 4-bit weights (W4A16); 8-bit weights "
                             "round to nearest")
        if self.smooth is not None:
            if self.scheme != "w8a8":
                raise ValueError(f"smooth={self.smooth!r} is SmoothQuant, for W8A8 only "
                                 f"(this is {self.scheme.upper()})")
            if not (isinstance(self.smooth, (int, float)) and 0 < self.smooth <= 1):
                raise ValueError(f"smooth must be a migration strength in (0, 1], got "
                                 f"{self.smooth!r}")

    @property
    def scheme(self) -> str:
        return SCHEMES[(self.weight_bits, self.act_bits)]

    @property
    def needs_data(self) -> bool:
        """Whether quantizing needs calibration inputs (GPTQ's Hessian, SmoothQuant's
        activation ranges)."""
        return self.method == "gptq" or self.smooth is not None

    @property
    def name(self) -> str:
        if self.weight_bits == 4:
            zp = {"int": "", "none": " sym", "float": " fzero"}[self.zero_point]
            return f"W4A16 g{self.group_size}{zp}" + (" gptq" if self.method == "gptq"
                                                       else "")
        return self.scheme.upper() + ("" if self.smooth is None else f" sq{self.smooth:g}")


def w8a8(smooth: float | None = None, **kw) -> QuantConfig:
    return QuantConfig(8, 8, None, smooth=smooth, **kw)


def w8a16(**kw) -> QuantConfig:
    return QuantConfig(8, 16, None, **kw)


def w4a16(group_size: int = 64, zero_point: str | bool = "int", method: str = "rtn",
          **kw) -> QuantConfig:
    return QuantConfig(4, 16, group_size, zero_point, method=method, **kw)


@struct.dataclass
class QuantizedLinear(LinearWeight):
    """One quantized [K, N] weight; `linear(x)` is the layer's matmul (module docstring).

    qvalue: int8 [K, N] (8-bit) or uint8 [K/2, N] packed nibbles (4-bit);
    scale: f32 [1, N] (8-bit) or [K/G, N]; zero: [K/G, N] 4-bit zero points (uint8
    integer or float16) or None; act_scale: f32 [K] SmoothQuant's 1/s, multiplied into
    the activations before they are quantized, or None.
    """

    qvalue: jax.Array
    scale: jax.Array
    zero: jax.Array | None
    act_scale: jax.Array | None
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
        w = self.qvalue.astype(jnp.float32) * self.scale
        if self.act_scale is not None:  # the smoothed weight's rows were multiplied by s
            w = w * self.act_scale[:, None]
        return w.astype(dtype)

    def linear(self, x: jax.Array) -> jax.Array:
        k, n = self.shape
        if x.shape[-1] != k:
            raise ValueError(f"quantized weight expects inputs [..., {k}], got {x.shape=}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        impl = self.config.implementation
        scheme = self.config.scheme
        if scheme == "w8a8":
            x32 = x2.astype(jnp.float32)
            if self.act_scale is not None:
                x32 = x32 * self.act_scale
            xa = qwix.quantize(x32, jnp.int8, channelwise_axes=(0,))
            y = int8_matmul(xa.qvalue, xa.scale, self.qvalue, self.scale,
                            implementation=impl)
        elif scheme == "w8a16":
            y = jnp.dot(x2, self.qvalue.astype(x2.dtype),
                        preferred_element_type=jnp.float32) * self.scale
        else:
            y = int4_matmul(x2, self.qvalue, self.scale.astype(x2.dtype), self.zero,
                            group_size=self.config.group_size, implementation=impl)
        return y.astype(x.dtype).reshape(*lead, n)


def quantize_weight(w: jax.Array, config: QuantConfig, name: str = "weight",
                    stats: InputStats | None = None) -> QuantizedLinear:
    """Quantize one float [K, N] weight (K inputs, N outputs); `name` labels errors.
    `stats`: the layer's calibration inputs (calib.input_stats), needed when
    `config.needs_data` (GPTQ, SmoothQuant)."""
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a QuantConfig, got {type(config).__name__}")
    if w.ndim != 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"{name}: expected a float [in, out] weight, got {w.shape=} "
                         f"{w.dtype=}")
    k, n = w.shape
    if config.weight_bits == 4 and k % config.group_size:
        raise ValueError(f"{name}: group_size={config.group_size} does not divide the input "
                         f"dim {k} of its [{k}, {n}] weight")
    if config.needs_data:
        if stats is None:
            raise ValueError(f"{name}: {config.name} needs calibration inputs (stats=); "
                             "through the transform, pass CalibrationData to calibrate")
        if stats.absmax.shape != (k,):
            raise ValueError(f"{name}: stats are for inputs of width {stats.absmax.shape}, "
                             f"the weight takes {k}")
    w32 = jnp.asarray(w, jnp.float32)
    if not bool(jnp.isfinite(w32).all()):
        raise ValueError(f"{name}: non-finite values (NaN/inf) in the float weight: "
                         "refusing to quantize (its scales would be NaN)")
    act_scale = zero = None
    if config.weight_bits == 8:
        if config.smooth is not None:
            s = smooth_quant.compute_scales_ratio(
                jnp.asarray(stats.absmax, jnp.float32), jnp.max(jnp.abs(w32), axis=1),
                config.smooth)
            w32, act_scale = w32 * s[:, None], (1.0 / s).astype(jnp.float32)
        qvalue, scale = _int8_codes(w32)
    else:
        g, zp = config.group_size, config.zero_point
        codes, scale, zero = (gptq_quantize(w32, stats.hessian, group=g, zero_point=zp)
                              if config.method == "gptq" else
                              rtn_quantize(w32, group=g, zero_point=zp))
        qvalue = pack_int4(codes, g)
    check_finite_scale(scale, name)
    return QuantizedLinear(qvalue, scale, zero, act_scale, config, (k, n))


@jax.jit
def _int8_codes(w32):
    """int8 codes [K, N] and f32 scales [1, N] (qwix absmax per output channel)."""
    qa = qwix.quantize(w32, jnp.int8, channelwise_axes=(1,))
    return qa.qvalue, qa.scale.reshape(1, -1)


def check_finite_scale(scale, name: str) -> None:
    """A NaN/inf scale (NaN weights, a damaged checkpoint) is an error naming the weight."""
    s = np.asarray(scale)
    if not np.isfinite(s).all():
        bad = np.argwhere(~np.isfinite(s))[0].tolist()
        raise ValueError(f"{name}: non-finite quantization scale at index {bad} "
                         f"({int((~np.isfinite(s)).sum())} of {s.size}); the float weight "
                         "has NaN/inf or the quantized state is damaged")
