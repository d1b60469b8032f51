"""Ring-buffer layout for sliding-window layers: memory is `window` tokens, not the context."""
from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from research.kv.base import KVCache, check_codec, poison_rows, scatter_tokens
from research.kv.codec import FloatCodec, KVCodec, KVView


@struct.dataclass
class WindowKVCache(KVCache):
    """Keeps the records of the last `window` tokens of each sequence in a ring of
    `window` slots (slot = position % window), encoded by `codec`."""

    window: int = struct.field(pytree_node=False)
    codec: KVCodec = FloatCodec()

    def __post_init__(self):
        check_codec(self.codec)
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    def init(self, batch, max_len, n_kv_heads, head_dim):
        return {**self.codec.empty((batch, self.window), n_kv_heads, head_dim),
                "pos": jnp.full((batch, self.window), -1, jnp.int32)}

    def update_and_attend(self, state, q, k, v, *, start, n_new, window):
        if window is None or window > self.window:
            raise ValueError(f"WindowKVCache(window={self.window}) cannot serve attention "
                             f"with window={window}")
        t = q.shape[1]
        q_pos = start[:, None] + jnp.arange(t)[None, :]
        new_valid = jnp.arange(t)[None, :] < n_new[:, None]
        chunk = self.codec.encode(k, v, q_pos)
        ring = {name: buf for name, buf in state.items() if name != "pos"}
        # Attend over (ring before this chunk) + (the encoded chunk), so a chunk longer
        # than the ring still sees its own earlier tokens.
        view = KVView({name: jnp.concatenate([ring[name], chunk[name].astype(ring[name].dtype)],
                                             axis=1) for name in ring},
                      q_pos, jnp.concatenate([state["pos"], q_pos], axis=1),
                      jnp.concatenate([state["pos"] >= 0, new_valid], axis=1), window,
                      positional=False)
        out = poison_rows(self.codec.attend(q, view), self.codec.check_finite(k, v))
        # Write only the last `window` real tokens (earlier ones would collide in the ring).
        keep = new_valid & (jnp.arange(t)[None, :] >= n_new[:, None] - self.window)
        slots = jnp.where(keep, q_pos % self.window, self.window)
        state = {**{name: scatter_tokens(ring[name], slots, chunk[name]) for name in ring},
                 "pos": scatter_tokens(state["pos"], slots, q_pos)}
        return out.astype(q.dtype), state

    def truncate(self, state, lengths):
        """Ring slots holding positions >= lengths[b] are emptied; the ring must be wide
        enough (window + rollback depth) to still hold the window before them."""
        return {**state, "pos": jnp.where(state["pos"] >= lengths[:, None], -1, state["pos"])}

    def capacity(self, max_len):
        return max_len  # positions are bounded by RoPE/max_len, not by the ring

    def describe(self):
        return f"window{self.window}[{self.codec.describe()}]"
