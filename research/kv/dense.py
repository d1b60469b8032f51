"""Dense layout: one [B, max_len, ...] buffer per record of the layer's codec.

Decode steps read the buffers through the codec's paged decode kernel (`page_reader`) on
TPU and GPU: a row's buffer is its pages laid end to end, so [B, S, ...] viewed as
[B * S / P, P, ...] pages with the identity block table is the same memory (a reshape,
no copy). One kernel per codec then serves both layouts.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kernels_pallas.dispatch import IMPLEMENTATIONS
from research.kv.base import (KVCache, check_codec, lookback_positions, poison_rows,
                              scatter_tokens, take_tokens)
from research.kv.codec import SEQ, FloatCodec, KVCodec, KVView, PageRead, decode_through_reader

PAGE_VIEW_SIZES = (64, 32, 16)  # page size of the dense-as-pages view: the largest dividing S


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

    implementation: decode steps of a codec with a page reader (module docstring): "auto"
      (XLA on CPU, the kernel on TPU and GPU, chosen at lowering), "xla" or "pallas".
      Used when max_len is a multiple of 16; prefill chunks always attend in XLA.
    """

    codec: KVCodec = FloatCodec()
    implementation: str = struct.field(pytree_node=False, default="auto")
    interpret: bool = struct.field(pytree_node=False, default=False)

    def __post_init__(self):
        check_codec(self.codec)
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, "
                             f"got {self.implementation!r}")

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
        earlier = None
        if self.codec.lookback:
            slots = lookback_positions(start, self.codec.lookback)
            earlier = {name: take_tokens(buf, slots) for name, buf in bufs.items()}
        w = self.codec.write(k, v, q_pos, valid, state.get(SEQ), earlier)
        slots = masked_slots(w.positions, w.valid, n_slots)
        new = {name: scatter_tokens(buf, slots, w.records[name]) for name, buf in bufs.items()}
        lengths = start + n_new
        kv_pos = jnp.broadcast_to(jnp.arange(n_slots)[None, :], (b, n_slots))
        view = KVView(new, q_pos, kv_pos, kv_pos < lengths[:, None], window,
                      positional=True, lengths=lengths, extra=w.extra)
        out = self._decode_through_pages(q, view) if t == 1 else None
        if out is None:
            out = self.codec.attend(q, view)
        out = poison_rows(out, either_bad(self.codec.check_finite(k, v), w.bad_rows))
        if w.seq_state is not None:
            new[SEQ] = w.seq_state
        return out.astype(q.dtype), new

    def leading_slots(self, state, n):
        bufs = records_of(state)
        n_slots = next(iter(bufs.values())).shape[1]
        if n >= n_slots or n % self.codec.align:
            return None
        return {**state, **{name: x[:, :n] for name, x in bufs.items()}}

    def with_leading_slots(self, state, part):
        out = dict(part)  # the codec's per-sequence state comes from the piece
        for name, x in records_of(state).items():
            out[name] = jax.lax.dynamic_update_slice_in_dim(x, part[name], 0, axis=1)
        return out

    def _decode_through_pages(self, q, view: KVView):
        """The codec's page reader over the buffers viewed as pages (module docstring), or
        None: no reader, "xla", or no page size dividing the buffers."""
        bufs, window = view.records, view.window
        b, n_slots = next(iter(bufs.values())).shape[:2]
        page = next((p for p in PAGE_VIEW_SIZES if n_slots % p == 0), None)
        if self.implementation == "xla" or page is None:
            return None
        reader = self.codec.page_reader(window, PageRead(self.implementation, None,
                                                         self.interpret))
        if reader is None:
            return None
        pages = {name: x.reshape((b * n_slots // page, page) + x.shape[2:])
                 for name, x in bufs.items()}
        table = jnp.arange(b * n_slots // page, dtype=jnp.int32).reshape(b, n_slots // page)

        def xla(q, pages, table, lengths):  # the layout's own read (CPU under "auto")
            return self.codec.attend(q, view)
        return decode_through_reader(reader, self.implementation, q, pages, table,
                                     view.lengths, xla)

    def describe(self):
        return f"dense[{self.codec.describe()}]"
