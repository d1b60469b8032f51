"""KIVI-style low-bit KV codec (Liu et al., 2024), in any layout (dense, window ring, pages).

Keys are quantised per channel over groups of `key_group` consecutive positions (keys have
outlier channels, so a channel shares one scale/zero across tokens); values per token over
groups of `value_group` channels. The `residual` most recent tokens are also kept in full
precision (`residual_dtype`) in a per-sequence ring of `residual + rollback` slots.

Records (per token, so any layout stores them; slot groups are aligned to position groups,
`align = key_group`):

    k_codes [Hkv, D*bits/8] uint8   key codes of the token
    k_stats [Hkv, P] float16        piece j of its group's per-channel key (scale, zero),
                                    j = position % key_group, P = ceil(2D / key_group)
    v_codes [Hkv, D*bits/8] uint8, v_scale / v_zero [Hkv, D/value_group] float16

A group's key codes depend on all its tokens, so `write` re-emits the records of the
chunk's first group from its earlier tokens (read from the full-precision ring) together
with the chunk: a group's records are always written whole, by the write that extends it.

Reads (KIVI's residual, made position-exact so prefill and decode agree and every layout
gives the same result): a query at position t reads cached position p from the
full-precision ring exactly when t - p < residual, and from the codes otherwise;
`residual >= key_group` guarantees that every position read from codes lies in a group
that was complete when it was written.

Served from shared pages (the engine re-binds rows, so no per-sequence ring): under a
bfloat16 sink + recent window (research/kv/windowed.py, registry "kivi-2bit+w128") the
window is KIVI's residual, and it writes each group whole through `encode_groups` from its
own copies of the group's earlier tokens; the ring below is then unused.

Rollback by length: a write at `start` first forgets every ring entry at or past `start`,
so a rolled-back sequence needs no truncate call. It is exact while the rollback depth is
at most `rollback` (the ring still holds the `residual` tokens before the new end and the
earlier tokens of its group); a deeper one would need dropped tokens: those rows come out
NaN (never silently wrong).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from research.core.attention import attention_mask, gqa_scores, masked_softmax_weights
from research.kv.base import scatter_tokens
from research.kv.codec import KVCodec, Written
from research.kv.quantized import (SCALE_DTYPE, dequantize_uniform, pack_bits,
                                   quantize_uniform, unpack_bits)


@struct.dataclass
class KIVICodec(KVCodec):
    bits: int = struct.field(pytree_node=False, default=2)
    key_group: int = struct.field(pytree_node=False, default=32)
    value_group: int = struct.field(pytree_node=False, default=32)
    residual: int = struct.field(pytree_node=False, default=128)
    residual_dtype: str = struct.field(pytree_node=False, default="bfloat16")
    rollback: int = struct.field(pytree_node=False, default=0)

    def __post_init__(self):
        if self.bits not in (1, 2, 4):
            raise ValueError(f"bits must be 1, 2 or 4, got {self.bits}")
        if self.key_group < 1 or self.value_group < 1:
            raise ValueError(f"key_group and value_group must be >= 1, got "
                             f"{self.key_group=}, {self.value_group=}")
        if self.residual < self.key_group:
            raise ValueError(f"residual ({self.residual}) must be >= key_group "
                             f"({self.key_group}): a key group is quantised from the ring")
        if self.rollback < 0:
            raise ValueError(f"rollback must be >= 0, got {self.rollback}")

    @property
    def align(self) -> int:
        return self.key_group

    @property
    def ring(self) -> int:
        return self.residual + self.rollback

    def _pieces(self, head_dim: int) -> int:
        return -(-2 * head_dim // self.key_group)

    def record_spec(self, n_kv_heads, head_dim):
        if head_dim % self.value_group:
            raise ValueError(f"value_group={self.value_group} must divide head_dim={head_dim}")
        if (head_dim * self.bits) % 8:
            raise ValueError(f"head_dim * bits = {head_dim * self.bits} must be a multiple of 8")
        h, d = n_kv_heads, head_dim
        codes = jax.ShapeDtypeStruct((h, d * self.bits // 8), jnp.dtype(jnp.uint8))
        vstat = jax.ShapeDtypeStruct((h, d // self.value_group), jnp.dtype(SCALE_DTYPE))
        return {"k_codes": codes,
                "k_stats": jax.ShapeDtypeStruct((h, self._pieces(d)), jnp.dtype(SCALE_DTYPE)),
                "v_codes": codes, "v_scale": vstat, "v_zero": vstat}

    def init_seq_state(self, batch, n_kv_heads, head_dim):
        r, h, d = self.ring, n_kv_heads, head_dim
        return {"ring_k": jnp.zeros((batch, r, h, d), self.residual_dtype),
                "ring_v": jnp.zeros((batch, r, h, d), self.residual_dtype),
                "ring_pos": jnp.full((batch, r), -1, jnp.int32)}

    def encode(self, k, v, positions):
        raise TypeError("KIVICodec's key codes depend on a whole group of positions: layouts "
                        "call write(k, v, positions, valid, seq_state), not encode")

    # -- writes ------------------------------------------------------------------------
    def write(self, k, v, positions, valid, seq_state, earlier=None):
        b, t, h, d = k.shape
        g, r = self.key_group, self.ring
        start = positions[:, 0]
        n_new = jnp.sum(valid, axis=1)
        ring_pos = jnp.where(seq_state["ring_pos"] >= start[:, None], -1,
                             seq_state["ring_pos"])  # rolled back: forgotten
        k_fp, v_fp = k.astype(self.residual_dtype), v.astype(self.residual_dtype)

        # The chunk's positions extended back to the start of its first group.
        n_groups = -(-(t + g - 1) // g)
        first = (start // g) * g
        pos = first[:, None] + jnp.arange(n_groups * g)[None, :]  # [B, T2]
        b_idx = jnp.arange(b)[:, None]
        in_chunk = pos >= start[:, None]
        slot = pos % r
        take = lambda chunk, ring: jnp.where(  # noqa: E731
            in_chunk[..., None, None], chunk[b_idx, jnp.clip(pos - start[:, None], 0, t - 1)],
            ring[b_idx, slot])
        kk = take(k_fp, seq_state["ring_k"]).astype(jnp.float32)
        vv = take(v_fp, seq_state["ring_v"]).astype(jnp.float32)
        stepping = n_new > 0
        rec_valid = (pos < (start + n_new)[:, None]) & stepping[:, None]
        records = self.encode_groups(kk, vv, rec_valid)

        # Exact only if the ring still holds the residual before the chunk (which covers
        # the group's earlier tokens): a deeper rollback than `rollback` is flagged.
        back = start[:, None] - jnp.arange(1, self.residual)[None, :]
        held = jnp.take_along_axis(ring_pos, back % r, axis=1) == back
        bad = stepping & jnp.any((back >= 0) & ~held, axis=1)

        # Full-precision copy for reads: ring (before the chunk) + the chunk.
        q_pos = positions
        extra = {"fp_k": jnp.concatenate([seq_state["ring_k"], k_fp], axis=1),
                 "fp_v": jnp.concatenate([seq_state["ring_v"], v_fp], axis=1),
                 "fp_pos": jnp.concatenate([ring_pos, q_pos], axis=1),
                 "fp_valid": jnp.concatenate([ring_pos >= 0, valid], axis=1)}
        keep = valid & (jnp.arange(t)[None, :] >= n_new[:, None] - r)
        slots = jnp.where(keep, q_pos % r, r)
        new_seq = {"ring_k": scatter_tokens(seq_state["ring_k"], slots, k_fp),
                   "ring_v": scatter_tokens(seq_state["ring_v"], slots, v_fp),
                   "ring_pos": scatter_tokens(ring_pos, slots, q_pos)}
        return Written(records, pos, rec_valid, new_seq, extra, bad)

    def encode_groups(self, k, v, valid):
        """Records of whole key groups [B, n * key_group] (module docstring's layout)."""
        b, n_tok, h, d = k.shape
        g = self.key_group
        if n_tok % g:
            raise ValueError(f"encode_groups takes whole groups of {g} positions, got "
                             f"{n_tok}")
        n_groups = n_tok // g
        # Keys: per channel over each group (only its real tokens count).
        kg = jnp.where(valid[..., None, None], k.astype(jnp.float32), 0.0)
        codes, scale, zero = quantize_uniform(kg.reshape(b, n_groups, g, h, d), self.bits,
                                              axes=(2,))
        stats = jnp.concatenate([scale[:, :, 0], zero[:, :, 0]], axis=-1)  # [B, n, H, 2D]
        p = self._pieces(d)
        stats = jnp.pad(stats, ((0, 0), (0, 0), (0, 0), (0, g * p - 2 * d)))
        stats = stats.reshape(b, n_groups, h, g, p).transpose(0, 1, 3, 2, 4)
        # Values: per token over channel groups.
        vg = v.astype(jnp.float32).reshape(b, n_tok, h, d // self.value_group,
                                           self.value_group)
        v_codes, v_scale, v_zero = quantize_uniform(vg, self.bits, axes=(-1,))
        return {"k_codes": pack_bits(codes.reshape(b, n_tok, h, d), self.bits),
                "k_stats": stats.reshape(b, n_tok, h, p).astype(SCALE_DTYPE),
                "v_codes": pack_bits(v_codes.reshape(b, n_tok, h, d), self.bits),
                "v_scale": v_scale[..., 0], "v_zero": v_zero[..., 0]}

    # -- reads -------------------------------------------------------------------------
    def decode_scores(self, q, records):
        """Scores of one decode query against the rebuilt keys (a window's fast step:
        only its S + W bfloat16 tokens are read besides the codes)."""
        keys, _ = self.decode(records, None)
        return gqa_scores(q[:, None], keys)[:, :, :, 0]

    def weighted_values(self, weights, records):
        _, vals = self.decode(records, None)
        b, hkv, j, _ = weights.shape
        out = jnp.einsum("bkjs,bskd->bkjd", weights, vals)
        return out.reshape(b, hkv * j, vals.shape[-1])

    def decode(self, records, positions):
        """Dense K and V of the stored codes (slots in groups of `key_group`)."""
        b, s, h, _ = records["k_codes"].shape
        g = self.key_group
        if s % g:
            raise ValueError(f"KIVI reads slot groups of {g}: got {s} slots")
        d = records["v_scale"].shape[-1] * self.value_group
        stats = records["k_stats"].reshape(b, s // g, g, h, -1).transpose(0, 1, 3, 2, 4)
        stats = stats.reshape(b, s // g, h, -1)[..., :2 * d]
        scale = jnp.repeat(stats[..., :d], g, axis=1)
        zero = jnp.repeat(stats[..., d:], g, axis=1)
        keys = dequantize_uniform(unpack_bits(records["k_codes"], self.bits), scale, zero)
        vc = unpack_bits(records["v_codes"], self.bits).reshape(b, s, h, d // self.value_group,
                                                                self.value_group)
        vals = dequantize_uniform(vc, records["v_scale"][..., None],
                                  records["v_zero"][..., None])
        return keys, vals.reshape(b, s, h, d)

    def attend(self, q, view):
        keys_q, vals_q = self.decode(view.records, view.kv_pos)
        fp = view.extra
        # Codes: every stored position at distance >= residual from the query.
        far = (view.q_pos[:, :, None] - view.kv_pos[:, None, :]) >= self.residual
        mask_q = view.mask() & far
        # Full precision: ring + chunk at distance < residual.
        near = (view.q_pos[:, :, None] - fp["fp_pos"][:, None, :]) < self.residual
        mask_fp = attention_mask(view.q_pos, fp["fp_pos"], fp["fp_valid"], view.window) & near
        keys = jnp.concatenate([keys_q, fp["fp_k"].astype(jnp.float32)], axis=1)
        vals = jnp.concatenate([vals_q, fp["fp_v"].astype(jnp.float32)], axis=1)
        mask = jnp.concatenate([mask_q, mask_fp], axis=-1)[:, None, None]  # [B,1,1,T,S']
        w = masked_softmax_weights(gqa_scores(q, keys), mask)
        b, t, hq, d = q.shape
        return jnp.einsum("bkgts,bskd->btkgd", w, vals).reshape(b, t, hq, d)

    def describe(self):
        rb = f", rollback={self.rollback}" if self.rollback else ""
        return (f"kivi[{self.bits}b, key_group={self.key_group}, value_group="
                f"{self.value_group}, residual={self.residual}{rb}]")
