"""Plain-JAX paged decode attention: the "xla" implementation and the kernels' oracle.

Pools are token-major pages [N, block_size, Hkv, D]; a row's pages, gathered through its
block table [B, M] (-1 = unmapped, masked), laid end to end are its tokens [B, M*bs, Hkv, D]
in the dense layout's order, so the core masked GQA attention
(`research.core.attention.attend`) runs on them unchanged.
"""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from research.core.attention import attend


def paged_decode_attention_reference(q: Float[Array, "B Hq D"],
                                     k_pool: Float[Array, "N S Hkv D"],
                                     v_pool: Float[Array, "N S Hkv D"],
                                     block_table: Int[Array, "B M"], lengths: Int[Array, "B"],
                                     window: int | None = None,
                                     k_scale: Float[Array, "N S Hkv 1"] | None = None,
                                     v_scale: Float[Array, "N S Hkv 1"] | None = None,
                                     ) -> Float[Array, "B Hq D"]:
    """One query per row at position lengths[b] - 1 over the row's first lengths[b] tokens.
    k_scale/v_scale: the pools hold int8 codes, token = code * scale (dequantized in f32)."""
    if k_scale is not None:
        k_pool = k_pool.astype(jnp.float32) * k_scale.astype(jnp.float32)
        v_pool = v_pool.astype(jnp.float32) * v_scale.astype(jnp.float32)
    q_pos = (lengths - 1)[:, None]
    out = paged_attention_reference(q[:, None], k_pool, v_pool, block_table, q_pos, lengths,
                                    window)
    return out[:, 0]


def gather_sequences(pool: Float[Array, "N S Hkv D"], table: Int[Array, "B M"]
                     ) -> Float[Array, "B L Hkv D"]:
    """Each row's pages laid end to end: [B, M*block_size, ...] (unmapped -> page 0).
    Works for any per-token record: pool [N, S, *rest] -> [B, M*S, *rest]."""
    b, m = table.shape
    g = pool[jnp.maximum(table, 0)]  # [B, M, S, ...]
    return g.reshape((b, m * pool.shape[1]) + pool.shape[2:])


def mapped_tokens(table: Int[Array, "B M"], block_size: int) -> Array:
    """[B, M*block_size] bool: the token slot lies in a mapped page (table entry >= 0)."""
    return jnp.repeat(table >= 0, block_size, axis=1)


def paged_attention_reference(q: Float[Array, "B T Hq D"], k_pool: Float[Array, "N S Hkv D"],
                              v_pool: Float[Array, "N S Hkv D"], table: Int[Array, "B M"],
                              q_pos: Int[Array, "B T"], lengths: Int[Array, "B"],
                              window: int | None) -> Float[Array, "B T Hq D"]:
    """Causal GQA attention over each row's first lengths[b] tokens, read through `table`."""
    keys, vals = gather_sequences(k_pool, table), gather_sequences(v_pool, table)
    kv_pos = jnp.broadcast_to(jnp.arange(keys.shape[1])[None, :], keys.shape[:2])
    kv_valid = mapped_tokens(table, k_pool.shape[1]) & (kv_pos < lengths[:, None])
    return attend(q, keys, vals, q_pos, kv_pos, kv_valid, window)
