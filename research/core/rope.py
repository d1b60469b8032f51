"""Rotary position embedding (half-split pairing), shared by the model and KV codecs."""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def rope_angles(positions: Int[Array, "..."], head_dim: int, theta: float) -> Array:
    """Rotation angles [..., head_dim // 2] for the given absolute positions."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    return positions.astype(jnp.float32)[..., None] * inv_freq


def apply_rope(x: Float[Array, "B T H D"], positions: Int[Array, "B T"], theta: float) -> Array:
    """Rotary embedding, half-split convention: channel i rotates with channel i + D/2.

    This is Hugging Face's `rotate_half` layout; the GGUF loader un-permutes llama.cpp's
    interleaved Q/K rows into it, so channel pairs are (i, i + D/2) everywhere in servax.
    """
    half = x.shape[-1] // 2
    ang = rope_angles(positions, x.shape[-1], theta)[:, :, None, :]  # [B, T, 1, D/2]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
