"""4-bit group grids and GPTQ over them.

Grids (`ZERO_POINTS`), all as unsigned codes u in [0, 15] with w ~ (u - zero) * scale per
group of `group` input rows and output column (kernels_pallas.quant_matmul's layout):
  * "none":  symmetric, zero = 8, scale = absmax / 7.5 (qwix `absmax`, its int4 bound);
  * "int":   asymmetric, integer zero in [0, 15] (qwix `minmax`: scale = (max - min) / 15,
             zero = round(-min / scale));
  * "float": asymmetric with a float zero, so the grid's low end is the group's minimum
             exactly (llama.cpp's Q4_1 grid: w = min + u * scale). qwix cannot express it
             (its zero point is stored in the integer qtype); it is why this module has
             its own grid code. The float zero is stored as float16, like Q4_1's minimum.

GPTQ (Frantar et al. 2022) quantizes a weight's input rows one at a time and pushes each
row's rounding error onto the rows not yet quantized, weighted by the inverse Hessian of the
layer's inputs (H = X^T X over calibration activations), so the layer's *outputs* stay
close rather than its weights. It follows qwix's GPTQ core (`qwix.contrib.gptq_core`: the
same Hessian inverse, damping, lazy block updates) rather than calling its
`quantize_weight`, for three reasons: qwix 0.x's loop raises on any asymmetric scheme (it
tests `zero_point and ...`, "truth value of an array"); it has no float-zero grid; and it
runs the column loop eagerly, one dispatch per op per column, where each block here is one
jitted `fori_loop`. With the symmetric grid the codes equal qwix's (tests/dynacore).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from qwix._src.core import qarray
from qwix.contrib import gptq_core

ZERO_POINTS = ("none", "int", "float")
ZERO_DTYPE = {"none": None, "int": jnp.uint8, "float": jnp.float16}  # as stored
BLOCK = 128  # columns per lazy-update block (GPTQ's default)
QMAX = 15
SYMMETRIC_ZERO = 8  # unsigned code of 0 in the symmetric grid (qwix int4 0 + 8)
_TINY = float(jnp.sqrt(jnp.finfo(jnp.float32).tiny))


def group_grid(w, zero_point: str):
    """Scale and zero of each row of w [N, group] (a row is one group): ([N, 1] f32,
    [N, 1] f32), the zero in the unsigned code domain. "none" / "int" are qwix's own
    `absmax` / `minmax` parameters (its int4 zero point + 8); "float" is min/max exactly."""
    if zero_point in ("none", "int"):
        how = qarray.HowToQuantize(qtype=jnp.int4, channelwise_axes=(0,),
                                   calibration_method="absmax" if zero_point == "none"
                                   else "minmax")
        scale, zp = gptq_core.find_params(w, how)
        zero = jnp.full_like(scale, SYMMETRIC_ZERO) if zp is None else \
            zp.astype(jnp.float32) + SYMMETRIC_ZERO
        return scale.astype(jnp.float32), zero
    lo = jnp.min(w, axis=-1, keepdims=True)
    scale = (jnp.max(w, axis=-1, keepdims=True) - lo) / QMAX
    scale = jnp.where(scale < _TINY, 1.0, scale)
    # stored as float16: round here so the codes are chosen against the stored zero
    zero = (-lo / scale).astype(jnp.float16).astype(jnp.float32)
    return scale, zero


def codes_of(w, scale, zero):
    """Nearest codes u in [0, 15] and the weights they stand for."""
    u = jnp.clip(jnp.round(w / scale + zero), 0, QMAX)
    return u, (u - zero) * scale


def rtn_quantize(w: jax.Array, *, group: int, zero_point: str):
    """Round-to-nearest on the grid: (codes uint8 [K, N], scale f32 [K/G, N], zero
    [K/G, N] (uint8 for "int", float16 for "float") or None for "none")."""
    k, n = w.shape
    g = jnp.asarray(w, jnp.float32).T.reshape(n * (k // group), group)
    scale, zero = group_grid(g, zero_point)
    u, _ = codes_of(g, scale, zero)
    per_group = lambda a: a.reshape(n, k // group).T  # noqa: E731
    return _stored(u.reshape(n, k).T, per_group(scale), per_group(zero), zero_point)


def _stored(codes, scale, zero, zero_point: str):
    """The arrays QuantizedLinear keeps: codes uint8, scale f32, zero per grid."""
    dtype = ZERO_DTYPE[zero_point]
    return (codes.astype(jnp.uint8), scale.astype(jnp.float32),
            None if dtype is None else zero.astype(dtype))


def inverse_hessian_factor(hessian: jax.Array, damp: float) -> jax.Array:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1; dead inputs (zero
    diagonal: a channel never active in calibration) get a unit diagonal."""
    k = hessian.shape[0]
    diag = jnp.diag(hessian)
    h = jnp.where((diag == 0) & jnp.eye(k, dtype=bool), 1.0, hessian)
    h = h + damp * jnp.mean(diag) * jnp.eye(k, dtype=h.dtype)
    return jnp.linalg.cholesky(gptq_core.cholesky_inverse(jnp.linalg.cholesky(h)), upper=True)


@functools.partial(jax.jit, static_argnames=("group", "zero_point"))
def _block(w_block, hinv_block, *, group: int, zero_point: str):
    """GPTQ over one block of columns of w^T ([N, b], whole groups). Returns (codes
    [N, b], scales [N, b/group], zeros [N, b/group], scaled errors [N, b])."""
    n, b = w_block.shape

    def body(i, carry):
        w1, err, codes, scales, zeros = carry
        g = i // group
        # a group's grid comes from its columns as they stand when the group starts
        # (every earlier column's error pushed in); the reference code reads the block's
        # pre-update copy, which makes grids depend on the block size: here they don't
        grp = jax.lax.dynamic_slice(w1, (0, g * group), (n, group))
        scale, zero = group_grid(grp, zero_point)
        start = i % group == 0
        scales = jnp.where(start, scales.at[:, g].set(scale[:, 0]), scales)
        zeros = jnp.where(start, zeros.at[:, g].set(zero[:, 0]), zeros)
        u, dq = codes_of(w1[:, i], scales[:, g], zeros[:, g])
        e = (w1[:, i] - dq) / hinv_block[i, i]
        w1 = w1 - jnp.outer(e, hinv_block[i])  # upper-triangular: columns >= i change
        return w1, err.at[:, i].set(e), codes.at[:, i].set(u), scales, zeros

    init = (w_block, jnp.zeros_like(w_block), jnp.zeros((n, b), jnp.float32),
            jnp.zeros((n, b // group), jnp.float32), jnp.zeros((n, b // group), jnp.float32))
    _, err, codes, scales, zeros = jax.lax.fori_loop(0, b, body, init)
    return codes, scales, zeros, err


def gptq_quantize(w: jax.Array, hessian: jax.Array, *, group: int, zero_point: str,
                  damp: float = 0.01):
    """GPTQ codes for a float [K, N] weight on the grid `zero_point` (same return as
    `rtn_quantize`). `hessian`: [K, K] X^T X of the layer's inputs (any positive scale)."""
    k, n = w.shape
    if hessian.shape != (k, k):
        raise ValueError(f"hessian must be [{k}, {k}] for a [{k}, {n}] weight, got "
                         f"{hessian.shape}")
    if k % group:
        raise ValueError(f"group={group} does not divide the input dim {k}")
    hessian = jnp.asarray(hessian, jnp.float32)
    hinv = inverse_hessian_factor(hessian, damp)
    wt = jnp.where(jnp.diag(hessian)[None, :] == 0, 0.0, jnp.asarray(w, jnp.float32).T)
    block = max(group, BLOCK // group * group)  # whole groups per block: none straddles
    codes, scales, zeros = [], [], []
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        c, s, z, err = _block(wt[:, i1:i2], hinv[i1:i2, i1:i2], group=group,
                              zero_point=zero_point)
        codes.append(c)
        scales.append(s)
        zeros.append(z)
        wt = wt.at[:, i2:].add(-err @ hinv[i1:i2, i2:])
    cat = lambda xs: jnp.concatenate(xs, axis=1).T  # noqa: E731
    return _stored(cat(codes), cat(scales), cat(zeros), zero_point)
