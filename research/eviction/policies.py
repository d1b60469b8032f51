"""Which context tokens an evicting KV cache keeps: one score per (token, KV head).

A policy looks at the prefill chunk (its queries, keys and the causal attention the chunk
computed anyway) and returns `scores[B, T, Hkv]`; the cache keeps, per row and KV head,
the `budget` highest-scoring real tokens. Policies that define a per-head choice (H2O,
SnapKV, key norm, random) score each KV head separately, aggregating over the query heads
of its GQA group; StreamingLLM keeps the same tokens in every head.

Scores of "always keep" tokens (sinks, the recent window, SnapKV's observation window) are
offset above every attention-derived score, so when the budget is smaller than the
protected set the most important protected tokens still win (sinks first, then the most
recent tokens).

Policies are frozen dataclasses: hashable, so they ride on the cache as static fields.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


class ScoreInputs(NamedTuple):
    """What the cache hands a policy for one prefill chunk."""

    q: Float[Array, "B T Hq D"]  # post-RoPE queries of the chunk
    k: Float[Array, "B T Hkv D"]  # post-RoPE keys of the chunk
    # causal attention of chunk queries over chunk keys; rows of padding queries are zero
    weights: Float[Array, "B Hkv G T T"]
    valid: Bool[Array, "B T"]  # real (non-padding) tokens
    n_new: Int[Array, "B"]  # real tokens per row
    budget: Int[Array, "B"]  # tokens each row keeps per KV head
    salt: Int[Array, ""]  # per-layer salt (random policy)


def _positions(inputs: ScoreInputs) -> Float[Array, "B T Hkv"]:
    b, t, hkv = inputs.k.shape[:3]
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.float32)[None, :, None], (b, t, hkv))


def _protect(scores: Array, protected: Array, t: int) -> Array:
    """Lift protected tokens above every score in [0, t] (later positions rank higher)."""
    pos = jnp.arange(scores.shape[1], dtype=jnp.float32)[None, :, None]
    return jnp.where(protected, 2.0 * (t + 1) + pos, scores)


@dataclasses.dataclass(frozen=True)
class StreamingLLM:
    """Attention sinks + recent window (Xiao et al., 2023): the first `sinks` tokens and
    the most recent ones; the budget beyond the sinks all goes to the recent window."""

    sinks: int = 4
    name: str = "streaming_llm"

    def __post_init__(self):
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")

    def scores(self, inputs: ScoreInputs) -> Array:
        pos = _positions(inputs)  # recency: later tokens score higher
        t = inputs.k.shape[1]
        return jnp.where(pos < self.sinks, 4.0 * (t + 1) - pos, pos)


@dataclasses.dataclass(frozen=True)
class H2O:
    """Heavy hitters + recent (Zhang et al., 2023): attention accumulated over all prefill
    queries (summed over the query group of each KV head) picks the heavy hitters;
    `recent_fraction` of the budget is reserved for the most recent tokens."""

    recent_fraction: float = 0.5
    name: str = "h2o"

    def __post_init__(self):
        if not 0.0 <= self.recent_fraction <= 1.0:
            raise ValueError(f"recent_fraction must be in [0, 1], got {self.recent_fraction}")

    def scores(self, inputs: ScoreInputs) -> Array:
        accumulated = jnp.sum(jnp.mean(inputs.weights, axis=2), axis=2)  # [B, Hkv, T] <= T
        scores = jnp.transpose(accumulated, (0, 2, 1))
        n_recent = jnp.floor(inputs.budget * self.recent_fraction).astype(jnp.int32)
        pos = _positions(inputs)
        recent = pos >= (inputs.n_new - n_recent)[:, None, None]
        return _protect(scores, recent, inputs.k.shape[1])


@dataclasses.dataclass(frozen=True)
class SnapKV:
    """Observation-window voting (Li et al., 2024): the last `window` prefill queries' attention
    to earlier tokens, averaged over each KV head's query group and smoothed by average
    pooling (`kernel` tokens), picks the prefix tokens; the window itself is always kept."""

    window: int = 32
    kernel: int = 5
    name: str = "snapkv"

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be a positive odd number, got {self.kernel}")

    def scores(self, inputs: ScoreInputs) -> Array:
        t = inputs.k.shape[1]
        pos = jnp.arange(t)[None, :]
        obs_start = (inputs.n_new - self.window)[:, None]  # [B, 1]
        in_window = (pos >= obs_start) & inputs.valid  # [B, T] observation queries/keys
        votes = jnp.einsum("bkgts,bt->bks", inputs.weights,
                           in_window.astype(inputs.weights.dtype)) / inputs.weights.shape[2]
        pooled = jax.lax.reduce_window(votes, 0.0, jax.lax.add, (1, 1, self.kernel),
                                       (1, 1, 1), "SAME") / self.kernel
        scores = jnp.transpose(pooled, (0, 2, 1))  # [B, T, Hkv], each <= window
        return _protect(scores, in_window[:, :, None], t + self.window)


@dataclasses.dataclass(frozen=True)
class RandomPolicy:
    """Control: a uniformly random subset per KV head (seeded; differs per layer via salt)."""

    seed: int = 0
    name: str = "random"

    def scores(self, inputs: ScoreInputs) -> Array:
        key = jax.random.fold_in(jax.random.key(self.seed), inputs.salt)
        return jax.random.uniform(key, inputs.k.shape[:3])


@dataclasses.dataclass(frozen=True)
class KeyNorm:
    """Control: keep the keys of smallest L2 norm (Devoto et al., 2024, 'a simple and
    effective L2 norm-based strategy'), per KV head."""

    name: str = "knorm"

    def scores(self, inputs: ScoreInputs) -> Array:
        return -jnp.linalg.norm(inputs.k.astype(jnp.float32), axis=-1)


POLICIES = {"streaming_llm": StreamingLLM, "h2o": H2O, "snapkv": SnapKV,
            "random": RandomPolicy, "knorm": KeyNorm}


def make_policy(policy, **options):
    """A policy object from its name (`POLICIES`) and options, or a policy passed through."""
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
        try:
            return POLICIES[policy](**options)
        except TypeError as e:
            raise TypeError(f"bad options for policy {policy!r}: {e}") from None
    if options:
        raise ValueError("policy options can only be given with a policy name")
    if not hasattr(policy, "scores") or not hasattr(policy, "name"):
        raise TypeError(f"policy must be a name in {sorted(POLICIES)} or an object with "
                        f"`scores(ScoreInputs)` and `name`, got {type(policy).__name__}")
    return policy
