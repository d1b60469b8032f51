"""KIVI-style low-bit KV cache (Liu et al., 2024), adapted to a fixed-shape JAX cache.

Keys are quantised per channel over blocks of `key_group` consecutive tokens (keys have
outlier channels, so a channel shares one scale/zero across tokens); values per token over
groups of `value_group` channels. The `residual` most recent tokens stay in full precision
(`residual_dtype`), held in a ring.

Adaptation (say it, because KIVI's residual length varies between 0 and R in the paper):
here a query at position t reads cached position p from the full-precision copy exactly when
t - p < residual, and from the quantised copy otherwise, for prefill and decode alike.
A key block is quantised as soon as its last token is written; `residual >= key_group`
guarantees that every token a query reads quantised lies in a complete block, and that the
earlier tokens of a block still sit in the ring when the block completes.
"""
from __future__ import annotations

import jax.numpy as jnp

from research.kv.base import KVCache, scatter_tokens, write_positions
from research.kv.quantized import (dequantize_uniform, pack_bits, quantize_uniform,
                                   unpack_bits)
from research.core.attention import attention_mask, gqa_scores, masked_softmax_weights
from flax import struct


@struct.dataclass
class KIVIKVCache(KVCache):
    bits: int = struct.field(pytree_node=False, default=2)
    key_group: int = struct.field(pytree_node=False, default=32)
    value_group: int = struct.field(pytree_node=False, default=32)
    residual: int = struct.field(pytree_node=False, default=128)
    residual_dtype: str = struct.field(pytree_node=False, default="bfloat16")

    def __post_init__(self):
        if self.bits not in (1, 2, 4):
            raise ValueError(f"bits must be 1, 2 or 4, got {self.bits}")
        if self.key_group < 1 or self.value_group < 1:
            raise ValueError(f"key_group and value_group must be >= 1, got "
                             f"{self.key_group=}, {self.value_group=}")
        if self.residual < self.key_group:
            raise ValueError(f"residual ({self.residual}) must be >= key_group "
                             f"({self.key_group}): a key block is quantised from the ring")

    def init(self, batch, max_len, n_kv_heads, head_dim):
        if head_dim % self.value_group:
            raise ValueError(f"value_group={self.value_group} must divide head_dim={head_dim}")
        if (head_dim * self.bits) % 8:
            raise ValueError(f"head_dim * bits = {head_dim * self.bits} must be a multiple of 8")
        h, d, r = n_kv_heads, head_dim, self.residual
        packed = (batch, max_len, h, d * self.bits // 8)
        n_blocks = -(-max_len // self.key_group)
        f16 = jnp.float16
        return {"k_codes": jnp.zeros(packed, jnp.uint8),
                "k_scale": jnp.zeros((batch, n_blocks, h, d), f16),
                "k_zero": jnp.zeros((batch, n_blocks, h, d), f16),
                "v_codes": jnp.zeros(packed, jnp.uint8),
                "v_scale": jnp.zeros((batch, max_len, h, d // self.value_group), f16),
                "v_zero": jnp.zeros((batch, max_len, h, d // self.value_group), f16),
                "ring_k": jnp.zeros((batch, r, h, d), self.residual_dtype),
                "ring_v": jnp.zeros((batch, r, h, d), self.residual_dtype),
                "ring_pos": jnp.full((batch, r), -1, jnp.int32)}

    # -- writes ------------------------------------------------------------------------
    def _write_values(self, state, v, slots):
        b, t, h, d = v.shape
        vg = v.reshape(b, t, h, d // self.value_group, self.value_group)
        codes, scale, zero = quantize_uniform(vg, self.bits, axes=(-1,))
        return {**state,
                "v_codes": scatter_tokens(state["v_codes"], slots,
                                          pack_bits(codes.reshape(b, t, h, d), self.bits)),
                "v_scale": scatter_tokens(state["v_scale"], slots, scale[..., 0]),
                "v_zero": scatter_tokens(state["v_zero"], slots, zero[..., 0])}

    def _write_keys(self, state, k_fp, start, n_new):
        """Quantise every key block this chunk completes, reading its earlier tokens from
        the ring (written before this chunk) and the rest from the chunk."""
        b, t, h, d = k_fp.shape
        gk, r = self.key_group, self.residual
        max_len, n_blocks = state["k_codes"].shape[1], state["k_scale"].shape[1]
        nb = -(-t // gk) + 1  # blocks a chunk of t tokens can touch
        blk = (start // gk)[:, None] + jnp.arange(nb)[None, :]  # [B, nb]
        pos = blk[:, :, None] * gk + jnp.arange(gk)[None, None, :]  # [B, nb, gk]
        complete = (blk + 1) * gk <= (start + n_new)[:, None]
        b_idx = jnp.arange(b)[:, None, None]
        from_chunk = k_fp[b_idx, jnp.clip(pos - start[:, None, None], 0, t - 1)]
        from_ring = state["ring_k"][b_idx, pos % r].astype(k_fp.dtype)
        in_chunk = (pos >= start[:, None, None])[..., None, None]
        blocks = jnp.where(in_chunk, from_chunk, from_ring)  # [B, nb, gk, H, D]
        codes, scale, zero = quantize_uniform(blocks, self.bits, axes=(2,))
        tok_slots = jnp.where(complete[:, :, None], pos, max_len).reshape(b, nb * gk)
        blk_slots = jnp.where(complete, blk, n_blocks)
        packed = pack_bits(codes, self.bits).reshape(b, nb * gk, h, -1)
        return {**state,
                "k_codes": scatter_tokens(state["k_codes"], tok_slots, packed),
                "k_scale": scatter_tokens(state["k_scale"], blk_slots, scale[:, :, 0]),
                "k_zero": scatter_tokens(state["k_zero"], blk_slots, zero[:, :, 0])}

    def _write_ring(self, state, k_fp, v_fp, q_pos, n_new):
        t = k_fp.shape[1]
        r = self.residual
        new_valid = jnp.arange(t)[None, :] < n_new[:, None]
        keep = new_valid & (jnp.arange(t)[None, :] >= n_new[:, None] - r)
        slots = jnp.where(keep, q_pos % r, r)
        return {**state, "ring_k": scatter_tokens(state["ring_k"], slots, k_fp),
                "ring_v": scatter_tokens(state["ring_v"], slots, v_fp),
                "ring_pos": scatter_tokens(state["ring_pos"], slots, q_pos)}

    # -- reads -------------------------------------------------------------------------
    def _dequantized(self, state):
        b, s, h, _ = state["k_codes"].shape
        d = state["k_scale"].shape[-1]
        block_of = jnp.arange(s) // self.key_group
        keys = dequantize_uniform(unpack_bits(state["k_codes"], self.bits),
                                  state["k_scale"][:, block_of], state["k_zero"][:, block_of])
        vc = unpack_bits(state["v_codes"], self.bits).reshape(b, s, h, d // self.value_group,
                                                               self.value_group)
        vals = dequantize_uniform(vc, state["v_scale"][..., None], state["v_zero"][..., None])
        return keys, vals.reshape(b, s, h, d)

    def update_and_attend(self, state, q, k, v, *, start, n_new, window):
        b, t = q.shape[:2]
        max_len = state["k_codes"].shape[1]
        k_fp = k.astype(self.residual_dtype)
        v_fp = v.astype(self.residual_dtype)
        q_pos = start[:, None] + jnp.arange(t)[None, :]
        old_ring = (state["ring_k"], state["ring_v"], state["ring_pos"])
        slots = write_positions(start, n_new, t, max_len)
        state = self._write_values(state, v_fp.astype(jnp.float32), slots)
        state = self._write_keys(state, k_fp.astype(jnp.float32), start, n_new)
        keys_q, vals_q = self._dequantized(state)
        # Quantised copy: every written position at distance >= residual from the query.
        kv_pos = jnp.broadcast_to(jnp.arange(max_len)[None, :], (b, max_len))
        far = (q_pos[:, :, None] - kv_pos[:, None, :]) >= self.residual
        mask_q = attention_mask(q_pos, kv_pos, kv_pos < (start + n_new)[:, None], window) & far
        # Full-precision copy: ring (before this chunk) + the chunk, at distance < residual.
        fp_pos = jnp.concatenate([old_ring[2], q_pos], axis=1)
        fp_valid = jnp.concatenate([old_ring[2] >= 0, jnp.arange(t)[None, :] < n_new[:, None]],
                                   axis=1)
        near = (q_pos[:, :, None] - fp_pos[:, None, :]) < self.residual
        mask_fp = attention_mask(q_pos, fp_pos, fp_valid, window) & near
        keys = jnp.concatenate([keys_q, jnp.concatenate([old_ring[0], k_fp], 1)
                                .astype(jnp.float32)], axis=1)
        vals = jnp.concatenate([vals_q, jnp.concatenate([old_ring[1], v_fp], 1)
                                .astype(jnp.float32)], axis=1)
        mask = jnp.concatenate([mask_q, mask_fp], axis=-1)[:, None, None]  # [B,1,1,T,S+R+T]
        w = masked_softmax_weights(gqa_scores(q, keys), mask)
        hq, d = q.shape[2], q.shape[3]
        out = jnp.einsum("bkgts,bskd->btkgd", w, vals).reshape(b, t, hq, d)
        state = self._write_ring(state, k_fp, v_fp, q_pos, n_new)
        return out.astype(q.dtype), state

    def describe(self):
        return (f"kivi[{self.bits}b, key_group={self.key_group}, value_group="
                f"{self.value_group}, residual={self.residual}]")
