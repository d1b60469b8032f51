"""Dense layout: a [B, max_len, Hkv, D] buffer per layer, stored in a chosen dtype."""
from __future__ import annotations

import jax.numpy as jnp

from research.kv.base import KVCache, scatter_tokens, write_positions
from research.core.attention import attend
from flax import struct


@struct.dataclass
class DenseKVCache(KVCache):
    """Stores K and V as they are, cast to `dtype` (f32, bf16, f16)."""

    dtype: str = struct.field(pytree_node=False, default="float32")

    def __post_init__(self):
        if jnp.dtype(self.dtype) not in (jnp.float32, jnp.bfloat16, jnp.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    def init(self, batch, max_len, n_kv_heads, head_dim):
        shape = (batch, max_len, n_kv_heads, head_dim)
        return {"k": jnp.zeros(shape, self.dtype), "v": jnp.zeros(shape, self.dtype)}

    def update_and_attend(self, state, q, k, v, *, start, n_new, window):
        max_len = state["k"].shape[1]
        slots = write_positions(start, n_new, q.shape[1], max_len)
        state = {"k": scatter_tokens(state["k"], slots, k),
                 "v": scatter_tokens(state["v"], slots, v)}
        q_pos = start[:, None] + jnp.arange(q.shape[1])[None, :]
        kv_pos = jnp.broadcast_to(jnp.arange(max_len)[None, :], (q.shape[0], max_len))
        kv_valid = kv_pos < (start + n_new)[:, None]
        out = attend(q, state["k"], state["v"], q_pos, kv_pos, kv_valid, window)
        return out, state

    def describe(self):
        return f"dense[{jnp.dtype(self.dtype).name}]"
