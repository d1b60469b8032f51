"""Sign-bit KV codec: QJL-style 1-bit keys (Zandieh et al., 2024) and 1-bit sign values.

Keys: a Gaussian projection P [D, m] (per KV head, fixed by a seed; m = D gives 1 bit per
channel) and one float16 norm per token; only sign(P^T k) is stored. The score estimator
    q.k ~= sqrt(pi/2) / m * |k| * (P^T q) . sign(P^T k)
is unbiased (the query is projected, not quantised).
Values: sign(v) and one float16 scale mean|v| per token (the L2-optimal scale for fixed
signs). Bits per channel: 1 + 16 / D for each of K and V.
The QJL paper keeps outlier channels apart and quantises values with more bits; this is the
plain all-1-bit variant, to compare codecs at equal bits.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array

from flax import struct

from research.core.attention import masked_softmax_weights
from research.kv.codec import KVCodec
from research.kv.quantized import SCALE_DTYPE, pack_bits, unpack_bits


def gaussian_projection(key: jax.Array, n_kv_heads: int, head_dim: int,
                        sketch_dim: int | None = None) -> Array:
    """[Hkv, D, m] i.i.d. N(0, 1) projections (m = D by default)."""
    m = head_dim if sketch_dim is None else sketch_dim
    if m < 8 or m % 8:
        raise ValueError(f"sketch_dim must be a positive multiple of 8, got {m}")
    return jax.random.normal(key, (n_kv_heads, head_dim, m), jnp.float32)


def _signs(x: Array) -> Array:
    """{0, 1} bits of x >= 0 (zero counts as positive)."""
    return (x >= 0).astype(jnp.uint8)


@struct.dataclass
class SignCodec(KVCodec):
    """Records "k_bits" [Hkv, m/8], "k_norm" [Hkv, 1], "v_bits" [Hkv, D/8], "v_scale"
    [Hkv, 1] per token; scores come from the sketch estimator, never from rebuilt keys."""

    projection: Array  # [Hkv, D, m]

    def record_spec(self, n_kv_heads, head_dim):
        if self.projection.shape[:2] != (n_kv_heads, head_dim):
            raise ValueError(f"projection must be [{n_kv_heads}, {head_dim}, m], got "
                             f"{self.projection.shape}")
        if head_dim % 8:
            raise ValueError(f"head_dim must be a multiple of 8 to pack sign bits, got "
                             f"{head_dim}")
        m = self.projection.shape[-1]

        def spec(width, dtype):
            return jax.ShapeDtypeStruct((n_kv_heads, width), jnp.dtype(dtype))
        return {"k_bits": spec(m // 8, jnp.uint8), "k_norm": spec(1, SCALE_DTYPE),
                "v_bits": spec(head_dim // 8, jnp.uint8), "v_scale": spec(1, SCALE_DTYPE)}

    def encode(self, k, v, positions):
        k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
        sketch = jnp.einsum("bthd,hdm->bthm", k32, self.projection)
        return {"k_bits": pack_bits(_signs(sketch), 1),
                "k_norm": jnp.linalg.norm(k32, axis=-1, keepdims=True).astype(SCALE_DTYPE),
                "v_bits": pack_bits(_signs(v32), 1),
                "v_scale": jnp.mean(jnp.abs(v32), axis=-1, keepdims=True).astype(SCALE_DTYPE)}

    def attend(self, q, view):
        b, t, hq, d = q.shape
        hkv, m = self.projection.shape[0], self.projection.shape[-1]
        rec = view.records
        k_sign = unpack_bits(rec["k_bits"], 1).astype(jnp.float32) * 2 - 1  # [B,S,H,m]
        v_hat = ((unpack_bits(rec["v_bits"], 1).astype(jnp.float32) * 2 - 1)
                 * rec["v_scale"].astype(jnp.float32))
        qg = q.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, d)
        q_sketch = jnp.einsum("btkgd,kdm->btkgm", qg, self.projection)
        scale = math.sqrt(math.pi / 2) / m / math.sqrt(d)
        scores = jnp.einsum("btkgm,bskm->bkgts", q_sketch, k_sign) * scale
        scores = scores * jnp.moveaxis(rec["k_norm"][..., 0].astype(jnp.float32), 1, 2
                                       )[:, :, None, None, :]
        w = masked_softmax_weights(scores, view.mask()[:, None, None])
        out = jnp.einsum("bkgts,bskd->btkgd", w, v_hat).reshape(b, t, hq, d)
        return out.astype(q.dtype)

    def describe(self):
        return f"sign[qjl keys m={self.projection.shape[-1]}, sign values]"
