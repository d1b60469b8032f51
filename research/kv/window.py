"""Ring-buffer layout for sliding-window layers: memory is `window` tokens, not the context."""
from __future__ import annotations

import jax.numpy as jnp

from research.kv.base import KVCache, scatter_tokens
from research.core.attention import attend
from flax import struct


@struct.dataclass
class WindowKVCache(KVCache):
    """Keeps the last `window` tokens of each sequence in a ring of `window` slots."""

    window: int = struct.field(pytree_node=False)
    dtype: str = struct.field(pytree_node=False, default="float32")

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    def init(self, batch, max_len, n_kv_heads, head_dim):
        shape = (batch, self.window, n_kv_heads, head_dim)
        return {"k": jnp.zeros(shape, self.dtype), "v": jnp.zeros(shape, self.dtype),
                "pos": jnp.full((batch, self.window), -1, jnp.int32)}

    def update_and_attend(self, state, q, k, v, *, start, n_new, window):
        if window is None or window > self.window:
            raise ValueError(f"WindowKVCache(window={self.window}) cannot serve attention "
                             f"with window={window}")
        b, t = q.shape[:2]
        q_pos = start[:, None] + jnp.arange(t)[None, :]
        new_valid = jnp.arange(t)[None, :] < n_new[:, None]
        # Attend over (ring before this chunk) + (the chunk), so a chunk longer than the
        # ring still sees its own earlier tokens.
        keys = jnp.concatenate([state["k"].astype(k.dtype), k], axis=1)
        vals = jnp.concatenate([state["v"].astype(v.dtype), v], axis=1)
        kv_pos = jnp.concatenate([state["pos"], q_pos], axis=1)
        kv_valid = jnp.concatenate([state["pos"] >= 0, new_valid], axis=1)
        out = attend(q, keys, vals, q_pos, kv_pos, kv_valid, window)
        # Write only the last `window` real tokens (earlier ones would collide in the ring).
        keep = new_valid & (jnp.arange(t)[None, :] >= n_new[:, None] - self.window)
        slots = jnp.where(keep, q_pos % self.window, self.window)
        state = {"k": scatter_tokens(state["k"], slots, k),
                 "v": scatter_tokens(state["v"], slots, v),
                 "pos": scatter_tokens(state["pos"], slots, q_pos)}
        return out, state

    def capacity(self, max_len):
        return max_len  # positions are bounded by RoPE/max_len, not by the ring

    def describe(self):
        return f"window{self.window}[{jnp.dtype(self.dtype).name}]"
