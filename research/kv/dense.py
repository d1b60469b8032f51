"""Dense layout: one [B, max_len, ...] buffer per record of the layer's codec."""
from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from research.kv.base import KVCache, check_codec, poison_rows, scatter_tokens, write_positions
from research.kv.codec import FloatCodec, KVCodec, KVView


@struct.dataclass
class DenseKVCache(KVCache):
    """Token p of row b lives in slot p of the row's buffers, encoded by `codec`.

    The chunk is encoded and written first, then read back like every older token, so
    prefill sees exactly what decode will see.
    """

    codec: KVCodec = FloatCodec()

    def __post_init__(self):
        check_codec(self.codec)

    def init(self, batch, max_len, n_kv_heads, head_dim):
        return self.codec.empty((batch, max_len), n_kv_heads, head_dim)

    def update_and_attend(self, state, q, k, v, *, start, n_new, window):
        b, t = q.shape[:2]
        max_len = next(iter(state.values())).shape[1]
        q_pos = start[:, None] + jnp.arange(t)[None, :]
        slots = write_positions(start, n_new, t, max_len)
        records = self.codec.encode(k, v, q_pos)
        state = {name: scatter_tokens(buf, slots, records[name]) for name, buf in state.items()}
        lengths = start + n_new
        kv_pos = jnp.broadcast_to(jnp.arange(max_len)[None, :], (b, max_len))
        view = KVView(state, q_pos, kv_pos, kv_pos < lengths[:, None], window,
                      positional=True, lengths=lengths)
        out = self.codec.attend(q, view)
        return poison_rows(out, self.codec.check_finite(k, v)).astype(q.dtype), state

    def describe(self):
        return f"dense[{self.codec.describe()}]"
