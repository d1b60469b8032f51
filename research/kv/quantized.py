"""Scalar-quantised KV codecs and the helpers the low-bit codecs share.

`Int8Codec`: symmetric int8 per (token, KV head) with a float16 scale: 8.25 bits per
channel at head_dim 64, a dense dequantise on read (the usual serving baseline), and its
transform `int8_kv()`. `Int4GroupCodec`: llama.cpp's q4_0 layout for K and V, symmetric
4-bit codes per group of 32 channels with a float16 scale (4.5 bits per channel), and
its transform `int4_kv()`. The template of a new codec (docs/extending.md): a record spec,
encode, decode, optionally a page reader, and one row in the codec table
(`BUILTIN` in research/serving/kv_codecs.py).

Helpers: `pack_bits` / `unpack_bits` (sub-byte integers packed along the last axis, low
bits first), `quantize_uniform` / `dequantize_uniform` (asymmetric min/max quantisation
along chosen axes, as KIVI uses).
"""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, UInt8

import jax
from flax import struct

from kernels_pallas.paged_attention.api import paged_decode_attention
from research.kv.codec import KVCodec

SCALE_DTYPE = jnp.float16


def pack_bits(values: UInt8[Array, "... N"], bits: int) -> UInt8[Array, "... M"]:
    """Pack integers in [0, 2**bits) along the last axis, 8 // bits per byte (low bits first)."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8, got {bits}")
    per_byte = 8 // bits
    n = values.shape[-1]
    if n % per_byte:
        raise ValueError(f"last axis ({n}) must be a multiple of {per_byte} to pack {bits}-bit "
                         "values")
    v = values.astype(jnp.uint8).reshape(values.shape[:-1] + (n // per_byte, per_byte))
    shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits)
    return jnp.sum(v << shifts, axis=-1, dtype=jnp.uint32).astype(jnp.uint8)


def unpack_bits(packed: UInt8[Array, "... M"], bits: int) -> UInt8[Array, "... N"]:
    """Inverse of `pack_bits`."""
    per_byte = 8 // bits
    shifts = jnp.arange(per_byte, dtype=jnp.uint8) * bits
    mask = jnp.uint8((1 << bits) - 1)
    v = (packed[..., None] >> shifts) & mask
    return v.reshape(packed.shape[:-1] + (packed.shape[-1] * per_byte,))


def quantize_uniform(x: Float[Array, "..."], bits: int, axes: tuple[int, ...]):
    """Asymmetric uniform quantisation with min/max taken over `axes`.

    Returns (codes uint8 in [0, 2**bits), scale, zero) with x ~= codes * scale + zero;
    scale and zero keep `axes` as size-1 dims and are stored in float16.
    """
    levels = (1 << bits) - 1
    x = x.astype(jnp.float32)
    lo = jnp.min(x, axis=axes, keepdims=True)
    hi = jnp.max(x, axis=axes, keepdims=True)
    scale = (hi - lo).astype(SCALE_DTYPE).astype(jnp.float32) / levels
    zero = lo.astype(SCALE_DTYPE).astype(jnp.float32)
    safe = jnp.where(scale > 0, scale, 1.0)
    codes = jnp.clip(jnp.round((x - zero) / safe), 0, levels).astype(jnp.uint8)
    return codes, scale.astype(SCALE_DTYPE), zero.astype(SCALE_DTYPE)


def dequantize_uniform(codes, scale, zero) -> Array:
    return codes.astype(jnp.float32) * scale.astype(jnp.float32) + zero.astype(jnp.float32)


def quantize_int8(x: Float[Array, "B T H D"]):
    """Symmetric int8 per (token, head): x ~= q * scale, scale = max|x| / 127 (float16)."""
    x = x.astype(jnp.float32)
    scale = (jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0).astype(SCALE_DTYPE)
    s = scale.astype(jnp.float32)
    q = jnp.round(x / jnp.where(s > 0, s, 1.0))
    return jnp.clip(q, -127, 127).astype(jnp.int8), scale


@struct.dataclass
class Int8Codec(KVCodec):
    """K and V as int8 per (token, KV head) with a float16 scale each; dense dequantise on read."""

    def record_spec(self, n_kv_heads, head_dim):
        codes = jax.ShapeDtypeStruct((n_kv_heads, head_dim), jnp.dtype(jnp.int8))
        scale = jax.ShapeDtypeStruct((n_kv_heads, 1), jnp.dtype(SCALE_DTYPE))
        return {"k": codes, "k_scale": scale, "v": codes, "v_scale": scale}

    def encode(self, k, v, positions):
        kq, ks = quantize_int8(k)
        vq, vs = quantize_int8(v)
        return {"k": kq, "k_scale": ks, "v": vq, "v_scale": vs}

    def decode(self, records, positions):
        return tuple(records[x].astype(jnp.float32) * records[f"{x}_scale"].astype(jnp.float32)
                     for x in ("k", "v"))

    def page_reader(self, window, read):
        """Decode steps on int8 pages: the paged kernel dequantizes a page tile at a time."""
        def reader(q, pages, table, lengths):
            return paged_decode_attention(q, pages["k"], pages["v"], table, lengths,
                                          window=window, k_scale=pages["k_scale"],
                                          v_scale=pages["v_scale"], **read._asdict())
        return reader

    def describe(self):
        return "int8[per-token]"


def int8_kv():
    """Transform: every layer's codec becomes Int8Codec, each keeping its layout."""
    from research.kv.layouts import replace_codecs
    from research.transforms import stateless
    return stateless(lambda model, state: replace_codecs(model, lambda i: Int8Codec(),
                                                         "int8_kv", "kv-int8"), "int8")


Q4_GROUP = 32  # channels per scale, llama.cpp's q4_0 block


def quantize_q4(x: Float[Array, "... D"], group: int = Q4_GROUP):
    """q4_0-style: per `group` channels d = m / -8 with m the signed value of largest
    magnitude, codes round(x / d) + 8 in [0, 15] packed two per byte; float16 d."""
    x = x.astype(jnp.float32)
    g = x.reshape(x.shape[:-1] + (x.shape[-1] // group, group))
    idx = jnp.argmax(jnp.abs(g), axis=-1, keepdims=True)
    m = jnp.take_along_axis(g, idx, axis=-1)
    d = (m / -8.0).astype(SCALE_DTYPE)
    df = d.astype(jnp.float32)
    q = jnp.round(g / jnp.where(df != 0, df, 1.0)) + 8
    codes = jnp.clip(q, 0, 15).astype(jnp.uint8).reshape(x.shape)
    return pack_bits(codes, 4), d[..., 0]


def dequantize_q4(packed, d, group: int = Q4_GROUP) -> Array:
    codes = unpack_bits(packed, 4).astype(jnp.float32) - 8
    g = codes.reshape(codes.shape[:-1] + (codes.shape[-1] // group, group))
    return (g * d.astype(jnp.float32)[..., None]).reshape(codes.shape)


@struct.dataclass
class Int4GroupCodec(KVCodec):
    """K and V in llama.cpp's q4_0 layout: 4-bit codes per `group`-channel group (32, as
    q4_0), a float16 scale per group (4.5 bits per channel at 32); dense dequantise on
    read."""

    group: int = struct.field(pytree_node=False, default=Q4_GROUP)

    def record_spec(self, n_kv_heads, head_dim):
        if self.group < 2 or self.group % 2 or head_dim % self.group:
            raise ValueError(f"Int4GroupCodec group must be even and divide head_dim="
                             f"{head_dim}, got group={self.group}")
        codes = jax.ShapeDtypeStruct((n_kv_heads, head_dim // 2), jnp.dtype(jnp.uint8))
        scale = jax.ShapeDtypeStruct((n_kv_heads, head_dim // self.group),
                                     jnp.dtype(SCALE_DTYPE))
        return {"k": codes, "k_scale": scale, "v": codes, "v_scale": scale}

    def encode(self, k, v, positions):
        (kq, ks), (vq, vs) = quantize_q4(k, self.group), quantize_q4(v, self.group)
        return {"k": kq, "k_scale": ks, "v": vq, "v_scale": vs}

    def decode(self, records, positions):
        return tuple(dequantize_q4(records[x], records[f"{x}_scale"], self.group)
                     for x in ("k", "v"))

    def describe(self):
        return f"int4[q4_0, group {self.group}]"


def int4_kv():
    """Transform: every layer's codec becomes Int4GroupCodec, each keeping its layout."""
    from research.kv.layouts import replace_codecs
    from research.transforms import stateless
    return stateless(lambda model, state: replace_codecs(model, lambda i: Int4GroupCodec(),
                                                         "int4_kv", "kv-int4"), "int4")
