"""FP8 (e4m3) KV codec with static scales, as vLLM's `kv_cache_dtype="fp8"` stores it.

Each layer keeps one float32 scale per KV head for K and one for V (`k_scale`, `v_scale`
[Hkv]); a per-tensor scale is the same value for every head. A token's K (V) is stored
as float8_e4m3fn(x / scale): one byte per channel, nothing per token. Scales come from
calibration (`research.tasq.baselines.fp8_kv`): amax / 448 over the calibration text, the
keys' amax taken over each RoPE pair's norm so that no later position's rotation can
exceed it. A value beyond +-448 x scale saturates at the largest finite e4m3 value (what
vLLM's cast does); the codec never writes NaN for a finite input.

The decode read folds the scales into the query and the output, exact because a scale is
constant over a head's tokens: q . (s_k k8) = (s_k q) . k8 and sum p (s_v v8) =
s_v sum p v8, so the paged kernel reads the fp8 pages as a float cache.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float

from kernels_pallas.paged_attention.api import paged_decode_attention
from research.kv.codec import KVCodec

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448


def to_fp8(x: Float[Array, "... H D"], scale: Float[Array, "H"]) -> Array:
    """x / scale (per head, the second-to-last axis) as e4m3, saturating at +-448."""
    y = x.astype(jnp.float32) / scale[:, None]
    return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def from_fp8(x8: Array, scale: Float[Array, "H"]) -> Array:
    return x8.astype(jnp.float32) * scale[:, None]


@struct.dataclass
class FP8Codec(KVCodec):
    """K and V as float8_e4m3fn with static per-KV-head scales [Hkv] (module docstring)."""

    k_scale: Array
    v_scale: Array
    per_head: bool = struct.field(pytree_node=False, default=True)

    def record_spec(self, n_kv_heads, head_dim):
        for name, s in (("k_scale", self.k_scale), ("v_scale", self.v_scale)):
            if s.shape != (n_kv_heads,):
                raise ValueError(f"FP8Codec {name} must have shape ({n_kv_heads},) (one scale "
                                 f"per KV head), got {s.shape}")
        spec = jax.ShapeDtypeStruct((n_kv_heads, head_dim), jnp.dtype(FP8_DTYPE))
        return {"k": spec, "v": spec}

    def encode(self, k, v, positions):
        return {"k": to_fp8(k, self.k_scale), "v": to_fp8(v, self.v_scale)}

    def decode(self, records, positions):
        return from_fp8(records["k"], self.k_scale), from_fp8(records["v"], self.v_scale)

    def page_reader(self, window, read):
        """The float paged kernel over fp8 pages, the scales folded into q and the output."""
        def reader(q, pages, table, lengths):
            hq, hkv = q.shape[1], self.k_scale.shape[0]
            per_q = lambda s: jnp.repeat(s, hq // hkv)[None, :, None]  # noqa: E731
            out = paged_decode_attention(q * per_q(self.k_scale).astype(q.dtype),
                                         pages["k"], pages["v"], table, lengths,
                                         window=window, **read._asdict())
            return out * per_q(self.v_scale).astype(out.dtype)
        return reader

    def describe(self):
        return f"fp8-e4m3[{'per-head' if self.per_head else 'per-tensor'}]"
