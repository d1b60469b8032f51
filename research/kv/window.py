"""Ring-buffer layout for sliding-window layers: memory is `window` tokens, not the context."""
from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from research.kv.base import (KVCache, check_codec, lookback_positions, poison_rows,
                              scatter_tokens, take_tokens)
from research.kv.codec import SEQ, FloatCodec, KVCodec, KVView
from research.kv.dense import either_bad, records_of


@struct.dataclass
class WindowKVCache(KVCache):
    """Keeps the records of the last `window` tokens of each sequence in a ring of
    `window` slots (slot = position % window), encoded by `codec`. The ring must be a
    multiple of the codec's `align` (slot groups stay aligned to position groups)."""

    window: int = struct.field(pytree_node=False)
    codec: KVCodec = FloatCodec()

    def __post_init__(self):
        check_codec(self.codec)
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.window % self.codec.align:
            raise ValueError(f"window ({self.window}) must be a multiple of the codec's "
                             f"align ({self.codec.align}, {self.codec.describe()})")

    def init(self, batch, max_len, n_kv_heads, head_dim):
        state = {**self.codec.empty((batch, self.window), n_kv_heads, head_dim),
                 "pos": jnp.full((batch, self.window), -1, jnp.int32)}
        seq = self.codec.init_seq_state(batch, n_kv_heads, head_dim)
        return state if seq is None else {**state, SEQ: seq}

    def update_and_attend(self, state, q, k, v, *, start, n_new, window):
        if window is None or window > self.window:
            raise ValueError(f"WindowKVCache(window={self.window}) cannot serve attention "
                             f"with window={window}")
        align = self.codec.align
        if self.window < window + align - 1:  # its oldest group would share slots
            raise ValueError(f"WindowKVCache(window={self.window}) must hold the attention "
                             f"window ({window}) plus align - 1 ({align - 1}) slots for "
                             f"{self.codec.describe()}: a group of positions is read whole")
        t = q.shape[1]
        q_pos = start[:, None] + jnp.arange(t)[None, :]
        new_valid = jnp.arange(t)[None, :] < n_new[:, None]
        ring = records_of(state)
        earlier = None
        if self.codec.lookback:  # the ring holds them (window >= align > lookback)
            slots = lookback_positions(start, self.codec.lookback) % self.window
            earlier = {name: take_tokens(x, slots) for name, x in ring.items()}
        w = self.codec.write(k, v, q_pos, new_valid, state.get(SEQ), earlier)
        # Attend over (ring before this write) + (the written records), so a chunk longer
        # than the ring still sees its own earlier tokens. Ring slots the write re-emits
        # (a codec's re-encoded group) are the written copies' now.
        first = jnp.min(jnp.where(w.valid, w.positions, jnp.iinfo(jnp.int32).max), axis=1)
        old_ok = (state["pos"] >= 0) & (state["pos"] < first[:, None])
        view = KVView({name: jnp.concatenate([ring[name],
                                              w.records[name].astype(ring[name].dtype)],
                                             axis=1) for name in ring},
                      q_pos, jnp.concatenate([state["pos"], w.positions], axis=1),
                      jnp.concatenate([old_ok, w.valid], axis=1), window,
                      positional=False, extra=w.extra)
        out = poison_rows(self.codec.attend(q, view),
                          either_bad(self.codec.check_finite(k, v), w.bad_rows))
        # Write only the last `window` written positions (earlier ones would collide).
        last = jnp.max(jnp.where(w.valid, w.positions, -1), axis=1)
        keep = w.valid & (w.positions > last[:, None] - self.window)
        slots = jnp.where(keep, w.positions % self.window, self.window)
        new = {**{name: scatter_tokens(ring[name], slots, w.records[name]) for name in ring},
               "pos": scatter_tokens(state["pos"], slots, w.positions)}
        if w.seq_state is not None:
            new[SEQ] = w.seq_state
        return out.astype(q.dtype), new

    def truncate(self, state, lengths):
        """Ring slots holding positions >= lengths[b] are emptied; the ring must be wide
        enough (window + rollback depth) to still hold the window before them."""
        return {**state, "pos": jnp.where(state["pos"] >= lengths[:, None], -1, state["pos"])}

    def capacity(self, max_len):
        return max_len  # positions are bounded by RoPE/max_len, not by the ring

    def describe(self):
        return f"window{self.window}[{self.codec.describe()}]"
