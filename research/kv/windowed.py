"""Full-precision sink and recent tokens over any low-bit codec (KIVI / CQ / StreamingLLM's
observation: the first few tokens and the last ~32-128 carry most of the attention mass,
so keeping them exact buys most of a low-bit cache's lost quality back).

`WindowedCodec(inner, sink=S, recent=W)` stores every token twice: the inner codec's
records and a bfloat16 copy ("k_hi", "v_hi"). A query at position q reads token p from the
bfloat16 copy when p < S or p > q - W (its own last W tokens, itself included), and from
the inner codec's records otherwise. So a sequence shorter than S + W is read exactly as
the bfloat16 codec reads it (to float rounding in the fast decode step below, whose
softmax sums fewer slots), and a token beyond both is read exactly as the inner codec
reads it (rebuilt K/V: `inner.decode`); the choice is per query, so a prefill chunk scores
every position as decode would reach it, whatever the chunking. A decode step of a codec
that scores its own codes (`KVCodec.decode_scores`: TaSQ's pre-RoPE rebuild read, the
post-RoPE lookup tables) reads them at the codec's speed and only the S + W window tokens
in bf16, one softmax over both; a prefill chunk of t tokens scores the rebuilt K/V once
(an online softmax, a block of slots at a time) and from the copies only the sink and the
band of S + W + t - 1 positions its queries read in bf16 (`_chunk_attend`; a context
inside S + W is read slot by slot, bf16's read exactly). SmolLM2's whole-model decode at
batch 4 x 8k, paged, on a 2-core CPU (`python scripts/bench_decode_step_long.py --steps 7 --codecs
bf16,tasq-1bit-post,tasq-1bit-post+w128`): bf16 9.44 tok/s, post-RoPE TaSQ 1-bit 20.43
(2.16x), with the window 19.14 (2.03x) one day; 1.42-1.54x and 1.33-1.39x on another day
of the same shared VM (two runs; issue 44's note): not a settled 2x.

Where the copies live is the layout's business: dense and ring layouts keep one per slot
(they are for development: their arrays are larger than bf16's); the paged layout keeps the
codes of every token in its pool and the copies in a second, small pool of window pages
that only the sink's blocks and each sequence's last W tokens hold (research/kv/paged.py;
the engine's bookkeeping: research/kv/window_pages.py), so a served sequence costs the
codec's bytes per token plus a bounded (S + W) x bf16. `kv_window(S, W)` wraps whatever
codec each layer has (research/kv/layouts.py, a transform applied after it); the
registry serves
"tasq-1bit+w128" (S = 4, W = 128: scripts/dev_tasq_calibration_positions.py, dev split).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from research.core.attention import (attention_mask, attention_partial, gqa_scores,
                                     masked_softmax_weights, merge_partials)
from research.kv.codec import KVCodec, KVView, Written

HI_RECORDS = ("k_hi", "v_hi")  # the full-precision copy, beside the inner codec's records


@struct.dataclass
class WindowedCodec(KVCodec):
    """`inner`'s records plus a bfloat16 copy read for the first `sink` tokens and each
    query's last `recent` tokens (module docstring)."""

    inner: KVCodec
    sink: int = struct.field(pytree_node=False, default=4)
    recent: int = struct.field(pytree_node=False, default=128)

    def __post_init__(self):
        if not isinstance(self.inner, KVCodec):
            raise TypeError(f"inner must be a KVCodec, got {type(self.inner).__name__}")
        if isinstance(self.inner, WindowedCodec):
            raise ValueError(f"{self.inner.describe()} already has a full-precision window")
        token_codec = (type(self.inner).write is KVCodec.write
                       and type(self.inner).init_seq_state is KVCodec.init_seq_state)
        if not (token_codec or self.grouped):
            raise ValueError(f"{self.inner.describe()} writes groups of tokens or keeps "
                             "per-sequence state without encode_groups; a window over it "
                             "is not supported")
        check_window(self.sink, self.recent)
        if self.grouped and self.recent < self.inner.align:
            raise ValueError(f"recent ({self.recent}) must be >= the inner codec's group "
                             f"({self.inner.align}, {self.inner.describe()}): a position "
                             "is read from codes only once its group is whole")

    @property
    def align(self):
        return self.inner.align

    @property
    def grouped(self) -> bool:
        """Whether the inner codec's records depend on a group of positions (KIVI): the
        window then writes each group whole from its own bfloat16 copies (`write`)."""
        return type(self.inner).encode_groups is not KVCodec.encode_groups

    @property
    def lookback(self):
        return self.inner.align - 1 if self.grouped else 0

    def record_spec(self, n_kv_heads, head_dim):
        hi = jax.ShapeDtypeStruct((n_kv_heads, head_dim), jnp.dtype(jnp.bfloat16))
        return {**self.inner.record_spec(n_kv_heads, head_dim),
                **{name: hi for name in HI_RECORDS}}

    def encode(self, k, v, positions):
        if self.grouped:
            raise TypeError(f"{self.describe()} writes whole groups: layouts call write")
        return {**self.inner.encode(k, v, positions),
                "k_hi": k.astype(jnp.bfloat16), "v_hi": v.astype(jnp.bfloat16)}

    def write(self, k, v, positions, valid, seq_state, earlier=None):
        """A token codec's records token by token; a grouped codec's (KIVI) records of
        every group the chunk touches, whole: the chunk's first group is re-emitted from
        the bfloat16 copies of its earlier positions (`earlier`, which the window keeps
        since recent >= the group), and every group is encoded from bfloat16 K/V, so its
        codes do not depend on how the sequence was chunked. The inner codec's own
        per-sequence state (KIVI's ring) is not used: the window replaces it."""
        if not self.grouped:
            return super().write(k, v, positions, valid, seq_state)
        b, t = positions.shape
        g, lb = self.inner.align, self.lookback
        start, n_new = positions[:, 0], jnp.sum(valid, axis=1)
        n_groups = -(-(t + g - 1) // g)
        pos = (start // g * g)[:, None] + jnp.arange(n_groups * g)[None, :]  # [B, N]
        rows = jnp.arange(b)[:, None]
        in_chunk = (pos >= start[:, None])[..., None, None]
        chunk_idx = jnp.clip(pos - start[:, None], 0, t - 1)
        earlier_idx = jnp.clip(pos - start[:, None] + lb, 0, max(lb - 1, 0))

        def full(x, name):  # bf16 K or V at `pos`: the chunk's, or the stored copy's
            fresh = x.astype(jnp.bfloat16)[rows, chunk_idx]
            if lb == 0:
                return fresh
            return jnp.where(in_chunk, fresh,
                             earlier[name][rows, earlier_idx].astype(jnp.bfloat16))
        kk, vv = full(k, "k_hi"), full(v, "v_hi")
        rec_valid = (pos < (start + n_new)[:, None]) & (n_new > 0)[:, None]
        records = {**self.inner.encode_groups(kk, vv, rec_valid), "k_hi": kk, "v_hi": vv}
        return Written(records, pos, rec_valid)

    def check_finite(self, k, v):
        return self.inner.check_finite(k, v)

    def decode(self, records, positions):
        return self.inner.decode(self._inner_records(records), positions)

    def attend(self, q, view: KVView):
        if q.shape[1] == 1 and view.positional and view.window is None:
            out = self._decode_step(q, view)
            if out is not None:
                return out
        if q.shape[1] > 1 and view.positional and view.lengths is not None:
            # a context inside S + W is all window: the slot-by-slot read is bf16's exactly
            # and cheap; longer ones score the codes once and the window's band apart
            return jax.lax.cond(jnp.max(view.lengths) <= self.sink + self.recent,
                                lambda: self._attend_by_slot(q, view),
                                lambda: self._chunk_attend(q, view))
        return self._attend_by_slot(q, view)

    def _attend_by_slot(self, q, view: KVView):
        """Any view: each slot scored both from the copies and from the rebuilt K/V, the
        query's choice kept (two whole-context score and value passes)."""
        k_lo, v_lo = self.inner.decode(self._inner_records(view.records), view.kv_pos)
        k_hi, v_hi = view.records["k_hi"], view.records["v_hi"]
        mask = view.mask()
        hi = self._reads_copy(view.q_pos, view.kv_pos)  # [B, T, S]
        hi, mask = hi[:, None, None], mask[:, None, None]  # [B, 1, 1, T, S]
        scores = jnp.where(hi, gqa_scores(q, k_hi), gqa_scores(q, k_lo))
        w = masked_softmax_weights(scores, mask)
        out = (jnp.einsum("bkgts,bskd->btkgd", jnp.where(hi, w, 0.0), v_hi.astype(jnp.float32))
               + jnp.einsum("bkgts,bskd->btkgd", jnp.where(hi, 0.0, w),
                            v_lo.astype(jnp.float32)))
        b, t, hq, d = q.shape
        return out.reshape(b, t, hq, d).astype(q.dtype)

    def _chunk_attend(self, q, view: KVView):
        """t > 1 queries of a positional view (slot s holds position s; q_pos = start +
        arange(t)): every slot scored once through the rebuilt K/V, and once more from
        the copies only the sink and the band [q_last - W - t + 2, q_last] that some query
        of the chunk reads in bf16 (S + W + t - 1 slots); one softmax over both."""
        t = q.shape[1]
        k_lo, v_lo = self.inner.decode(self._inner_records(view.records), view.kv_pos)
        # the window of the chunk's last query, widened by t - 1 to its first query's
        pos_c, valid_c = window_positions(view.q_pos[:, -1] + 1, self.sink,
                                          self.recent + t - 1)  # [B, C]
        idx = jnp.clip(pos_c, 0, view.kv_pos.shape[1] - 1)
        valid_c &= jnp.take_along_axis(view.kv_valid, idx, axis=1)
        take = lambda x: jnp.take_along_axis(x, idx[:, :, None, None], axis=1)  # noqa: E731
        lo_mask = view.mask() & ~self._reads_copy(view.q_pos, view.kv_pos)
        hi_mask = (attention_mask(view.q_pos, pos_c, valid_c, view.window)
                   & self._reads_copy(view.q_pos, pos_c))
        # the codes' part a block of slots at a time (no [T, S] scores at once), the band's
        # in one piece; one softmax over both
        return merge_partials((attention_partial(q, k_lo, v_lo, lo_mask),
                               attention_partial(q, take(view.records["k_hi"]),
                                                 take(view.records["v_hi"]), hi_mask,
                                                 block=pos_c.shape[1])), q.dtype)

    def _decode_step(self, q, view: KVView):
        """One query per row, at the inner codec's speed when it scores its codes
        (`KVCodec.decode_scores`): the codes' scores and the window's S + W bf16 scores
        in one softmax, values from codes and from the window. None: no such scores."""
        codes = self._inner_records(view.records)
        s_lo = self.inner.decode_scores(q[:, 0], codes)
        if s_lo is None:
            return None
        b, _, hq, d = q.shape
        pos_c, valid_c, k_c, v_c = self._window_set(view)
        qp = view.q_pos[:, :1]  # [B, 1]
        kp = view.kv_pos
        lo_mask = view.kv_valid & (kp <= qp) & ~self._reads_copy(qp, kp)[:, 0]
        hi_mask = valid_c & (pos_c <= qp) & self._reads_copy(qp, pos_c)[:, 0]
        s_hi = gqa_scores(q, k_c)[:, :, :, 0]  # [B, Hkv, J, C]
        mask = jnp.concatenate([lo_mask, hi_mask], axis=-1)[:, None, None]
        w = masked_softmax_weights(jnp.concatenate([s_lo, s_hi], axis=-1), mask)
        n = s_lo.shape[-1]
        out = self.inner.weighted_values(w[..., :n], codes)
        hi = jnp.einsum("bkjc,bckd->bkjd", w[..., n:], v_c.astype(jnp.float32))
        return (out.astype(jnp.float32) + hi.reshape(b, hq, d))[:, None].astype(q.dtype)

    def _reads_copy(self, q_pos, kv_pos):
        """[B, T, S]: whether a query at q_pos reads kv_pos from the bfloat16 copies (the
        sink, or its own last `recent` positions)."""
        qp, kp = q_pos[:, :, None], kv_pos[:, None, :]
        return (kp < self.sink) | (kp > qp - self.recent)

    def _window_set(self, view: KVView):
        """(positions [B, C], valid, K, V [B, C, Hkv, D]) of each row's first S and last
        W tokens: from the layout (`view.extra["window"]`: the paged layout gathers only
        these) or cut from the full copies."""
        if view.extra is not None and "window" in view.extra:
            return view.extra["window"]
        pos, valid = window_positions(view.lengths, self.sink, self.recent)
        idx = jnp.clip(pos, 0, view.kv_pos.shape[1] - 1)[:, :, None, None]
        take = lambda x: jnp.take_along_axis(x, idx, axis=1)  # noqa: E731
        return pos, valid, take(view.records["k_hi"]), take(view.records["v_hi"])

    def describe(self):
        return f"{self.inner.describe()}+sink{self.sink}+w{self.recent}(bf16)"

    @staticmethod
    def _inner_records(records):
        return {name: x for name, x in records.items() if name not in HI_RECORDS}


def window_positions(lengths, sink: int, recent: int):
    """(positions [B, S + W], valid) of each row's first `sink` and last `recent` tokens
    (a position in both is counted once, in the sink)."""
    head = jnp.broadcast_to(jnp.arange(sink)[None], (lengths.shape[0], sink))
    tail = lengths[:, None] - recent + jnp.arange(recent)[None]
    pos = jnp.concatenate([head, tail], axis=1).astype(jnp.int32)
    valid = jnp.concatenate([head < lengths[:, None], tail >= sink], axis=1)
    return pos, valid & (pos >= 0) & (pos < lengths[:, None])


def check_window(sink, recent) -> None:
    for name, value in (("sink", sink), ("recent", recent)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def is_windowed(codec: KVCodec) -> bool:
    return isinstance(codec, WindowedCodec)
