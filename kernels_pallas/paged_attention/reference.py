"""Plain-JAX paged decode attention: the "xla" implementation and the kernels' oracle.

Gathers each row's blocks through its block table and runs the core masked GQA attention
(`research.core.attention.attend`) for the single query at position lengths[b] - 1.
"""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from research.core.attention import attend


def paged_decode_attention_reference(q: Float[Array, "B Hq D"], k_pool: Float[Array, "Hkv N S D"],
                                     v_pool: Float[Array, "Hkv N S D"],
                                     block_table: Int[Array, "B M"], lengths: Int[Array, "B"],
                                     window: int | None = None) -> Float[Array, "B Hq D"]:
    q_pos = (lengths - 1)[:, None]
    out = paged_attention_reference(q[:, None], k_pool, v_pool, block_table, q_pos, lengths,
                                    window)
    return out[:, 0]


def gather_sequences(pool: Float[Array, "Hkv N S D"], table: Int[Array, "B M"]
                     ) -> Float[Array, "B L Hkv D"]:
    """Each row's blocks laid end to end: [B, M*block_size, Hkv, D] (unmapped -> block 0)."""
    hkv, _, s, d = pool.shape
    b, m = table.shape
    g = pool[:, jnp.maximum(table, 0)]  # [Hkv, B, M, S, D]
    return jnp.transpose(g, (1, 2, 3, 0, 4)).reshape(b, m * s, hkv, d)


def paged_attention_reference(q: Float[Array, "B T Hq D"], k_pool: Array, v_pool: Array,
                              table: Int[Array, "B M"], q_pos: Int[Array, "B T"],
                              lengths: Int[Array, "B"], window: int | None
                              ) -> Float[Array, "B T Hq D"]:
    """Causal GQA attention over each row's first lengths[b] tokens, read through `table`."""
    s = k_pool.shape[2]
    keys, vals = gather_sequences(k_pool, table), gather_sequences(v_pool, table)
    kv_pos = jnp.broadcast_to(jnp.arange(keys.shape[1])[None, :], keys.shape[:2])
    mapped = jnp.repeat(table >= 0, s, axis=1)
    kv_valid = mapped & (kv_pos < lengths[:, None])
    return attend(q, keys, vals, q_pos, kv_pos, kv_valid, window)
