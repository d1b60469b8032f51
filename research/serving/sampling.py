"""Next-token selection: greedy, or temperature / top-k / top-p sampling with explicit keys."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature == 0 means greedy; top_k == 0 and top_p == 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: Float[Array, "B V"], cfg: SamplingConfig) -> Array:
    """Temperature-scaled logits with everything outside top-k / top-p set to -inf."""
    logits = logits.astype(jnp.float32) / cfg.temperature
    if cfg.top_k:
        kth = jax.lax.top_k(logits, min(cfg.top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if cfg.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # smallest logit still inside the nucleus (the top token is always kept)
        keep = mass_before < cfg.top_p
        cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def sample(logits: Float[Array, "B V"], key: jax.Array, cfg: SamplingConfig) -> Array:
    """Next token per row, int32 [B]."""
    if cfg.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filter_logits(logits, cfg), axis=-1).astype(jnp.int32)


def token_probs(logits: Float[Array, "B V"], cfg: SamplingConfig) -> Array:
    """The exact distribution `sample` draws from (one-hot argmax when greedy)."""
    if cfg.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1])
    return jax.nn.softmax(filter_logits(logits, cfg), axis=-1)


def filter_logits_per_row(logits: Float[Array, "B V"], temperature: Float[Array, "B"],
                          top_k: Array, top_p: Float[Array, "B"]) -> Array:
    """`filter_logits` with each row's own temperature (> 0), top-k (0 = off) and top-p
    (1 = off): one compiled shape serves every mix of per-request settings."""
    v = logits.shape[-1]
    logits = logits.astype(jnp.float32) / temperature[:, None]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    kth = jnp.take_along_axis(sorted_logits, jnp.clip(top_k - 1, 0, v - 1)[:, None], axis=1)
    kth = jnp.where(top_k[:, None] > 0, kth, -jnp.inf)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    sorted_logits = jnp.where(sorted_logits < kth, -jnp.inf, sorted_logits)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < top_p[:, None]  # the top token is always kept
    cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    cutoff = jnp.where(top_p[:, None] < 1.0, cutoff, -jnp.inf)
    return jnp.where(logits < cutoff, -jnp.inf, logits)


def sample_per_row(logits: Float[Array, "B V"], temperature: Float[Array, "B"], top_k: Array,
                   top_p: Float[Array, "B"], key_data: Array) -> Array:
    """Next token per row, int32 [B]: greedy where temperature == 0, else a draw from the
    row's filtered distribution with the row's own key (`key_data` [B, 2] uint32), so a
    row's token does not depend on the other rows of the batch."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    hot = temperature > 0
    filtered = filter_logits_per_row(logits, jnp.where(hot, temperature, 1.0), top_k, top_p)
    keys = jax.random.wrap_key_data(key_data)
    drawn = jax.vmap(lambda k, x: jax.random.categorical(k, x))(keys, filtered)
    return jnp.where(hot, drawn.astype(jnp.int32), greedy)
