"""Plain-JAX paged decode attention: the "xla" implementation and the kernels' oracle.

Gathers each row's blocks through its block table and runs the core masked GQA attention
(`research.model.attention.attend`) for the single query at position lengths[b] - 1.
"""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from research.kv.paged import paged_attention_reference


def paged_decode_attention_reference(q: Float[Array, "B Hq D"], k_pool: Float[Array, "Hkv N S D"],
                                     v_pool: Float[Array, "Hkv N S D"],
                                     block_table: Int[Array, "B M"], lengths: Int[Array, "B"],
                                     window: int | None = None) -> Float[Array, "B Hq D"]:
    q_pos = (lengths - 1)[:, None]
    out = paged_attention_reference(q[:, None], k_pool, v_pool, block_table, q_pos, lengths,
                                    window)
    return out[:, 0]
