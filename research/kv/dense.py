"""Dense layout: one [B, max_len, ...] buffer per record of the layer's codec."""
from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from research.kv.base import KVCache, check_codec, poison_rows, scatter_tokens
from research.kv.codec import SEQ, FloatCodec, KVCodec, KVView


def records_of(state: dict) -> dict:
    """The record buffers of a dense or window layer state (no per-sequence state)."""
    return {name: x for name, x in state.items() if name not in (SEQ, "pos")}


def masked_slots(positions, valid, n_slots: int):
    """Slot of each written record: its position, or `n_slots` (dropped) where invalid."""
    return jnp.where(valid, positions, n_slots)


def either_bad(*rows):
    """Union of per-row failure flags (None = none)."""
    rows = [r for r in rows if r is not None]
    if not rows:
        return None
    out = rows[0]
    for r in rows[1:]:
        out = out | r
    return out


@struct.dataclass
class DenseKVCache(KVCache):
    """Token p of row b lives in slot p of the row's buffers, encoded by `codec`.

    The chunk is encoded and written first, then read back like every older token, so
    prefill sees exactly what decode will see. Buffers hold max_len slots rounded up to a
    multiple of the codec's `align`; a codec's per-sequence state sits under "seq".
    """

    codec: KVCodec = FloatCodec()

    def __post_init__(self):
        check_codec(self.codec)

    def init(self, batch, max_len, n_kv_heads, head_dim):
        slots = -(-max_len // self.codec.align) * self.codec.align
        state = self.codec.empty((batch, slots), n_kv_heads, head_dim)
        seq = self.codec.init_seq_state(batch, n_kv_heads, head_dim)
        return state if seq is None else {**state, SEQ: seq}

    def update_and_attend(self, state, q, k, v, *, start, n_new, window):
        b, t = q.shape[:2]
        bufs = records_of(state)
        n_slots = next(iter(bufs.values())).shape[1]
        q_pos = start[:, None] + jnp.arange(t)[None, :]
        valid = jnp.arange(t)[None, :] < n_new[:, None]
        w = self.codec.write(k, v, q_pos, valid, state.get(SEQ))
        slots = masked_slots(w.positions, w.valid, n_slots)
        new = {name: scatter_tokens(buf, slots, w.records[name]) for name, buf in bufs.items()}
        lengths = start + n_new
        kv_pos = jnp.broadcast_to(jnp.arange(n_slots)[None, :], (b, n_slots))
        view = KVView(new, q_pos, kv_pos, kv_pos < lengths[:, None], window,
                      positional=True, lengths=lengths, extra=w.extra)
        out = self.codec.attend(q, view)
        out = poison_rows(out, either_bad(self.codec.check_finite(k, v), w.bad_rows))
        if w.seq_state is not None:
            new[SEQ] = w.seq_state
        return out.astype(q.dtype), new

    def describe(self):
        return f"dense[{self.codec.describe()}]"
