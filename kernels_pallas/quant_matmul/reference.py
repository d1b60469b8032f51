"""Plain-JAX references (the "xla" implementation and the kernels' oracle).

int8 x int8 (prefill, W8A8):
    out[m, n] = (sum_k xq[m, k] * wq[k, n] as int32) * x_scale[m] * w_scale[n]

int4 weight x float activation (decode, W4A16), packed two nibbles per uint8 byte.
Layout ("half-split within each group", chosen so a kernel block of packed rows is a
whole number of groups and unpacking needs no interleave):

    packed [K/2, N] uint8, group size G (K % G == 0), byte row p = g * G/2 + r (r < G/2):
        low  nibble = u[g * G + r,       n]
        high nibble = u[g * G + G/2 + r, n]
    u in [0, 15] are unsigned codes; w[k, n] = (u[k, n] - zero[g, n]) * scale[g, n]
    with zero = 8 (symmetric) when no zero points are stored.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

SYMMETRIC_ZERO = 8  # the code of 0.0 in symmetric int4 (codes 0..15 = -8..7)


def int8_matmul_reference(xq: Int[Array, "M K"], x_scale: Float[Array, "M 1"],
                          wq: Int[Array, "K N"], w_scale: Float[Array, "1 N"]) -> Array:
    """int8 x int8 -> int32 accumulate, then the per-token x per-channel scales (f32)."""
    acc = jax.lax.dot_general(xq, wq, (((1,), (0,)), ((), ())),
                              preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * x_scale.astype(jnp.float32) * \
        w_scale.astype(jnp.float32)


def pack_int4(u: Int[Array, "K N"], group_size: int) -> Array:
    """Unsigned 4-bit codes [K, N] (values 0..15) -> packed [K/2, N] uint8 (layout above)."""
    k, n = u.shape
    g = group_size
    u = u.astype(jnp.uint8).reshape(k // g, 2, g // 2, n)
    return (u[:, 0] | (u[:, 1] << 4)).reshape(k // 2, n)


def unpack_int4(packed: Array, group_size: int) -> Array:
    """Inverse of pack_int4: [K/2, N] uint8 -> [K, N] uint8 codes."""
    k2, n = packed.shape
    g = group_size
    p = packed.reshape(k2 // (g // 2), 1, g // 2, n)
    return jnp.concatenate([p & 15, p >> 4], axis=1).reshape(2 * k2, n)


def dequantize_int4(packed: Array, scale: Float[Array, "KG N"], zero: Array | None,
                    group_size: int, dtype=jnp.float32) -> Array:
    """The whole dequantized weight [K, N] in `dtype`."""
    u = unpack_int4(packed, group_size).astype(jnp.float32)
    k, n = u.shape
    u = u.reshape(k // group_size, group_size, n)
    z = SYMMETRIC_ZERO if zero is None else zero.astype(jnp.float32)[:, None, :]
    w = (u - z) * scale.astype(jnp.float32)[:, None, :]
    return w.reshape(k, n).astype(dtype)


def int4_matmul_reference(x: Float[Array, "M K"], packed: Array, scale: Array,
                          zero: Array | None, group_size: int) -> Array:
    """x @ dequantize(w) in x's dtype (f32 accumulation)."""
    w = dequantize_int4(packed, scale, zero, group_size, x.dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
