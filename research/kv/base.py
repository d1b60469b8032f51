"""The KV-cache interface: how one layer's K/V are stored, written and read.

The model never touches cache arrays itself. Per layer it calls

    out, state = cache.update_and_attend(state, q, k, v, start=start, n_new=n_new, window=w)

where `q`, `k` are post-RoPE and the chunk's tokens sit at absolute positions
`start[b] + t`; only the first `n_new[b]` tokens of row b are real (the rest is padding
and must neither be stored nor disturb other tokens). Layouts (dense, ring window, paged),
codecs (bf16, int8, vector-quantised) and eviction policies are all implementations of
this one method, so a technique swaps the cache without touching the model.

A cache object is a pytree: hyper-parameters are static fields, calibrated arrays (e.g.
codebooks) are leaves. Its per-sequence storage is a separate `state` pytree made by
`init`, so one model can serve many batches.
"""
from __future__ import annotations

import abc
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

CacheState = Any  # pytree of arrays


class KVCache(abc.ABC):
    """Abstract per-layer KV cache. Subclasses are `pytree_dataclass`es."""

    @abc.abstractmethod
    def init(self, batch: int, max_len: int, n_kv_heads: int, head_dim: int) -> CacheState:
        """Empty storage for `batch` sequences of up to `max_len` tokens."""

    @abc.abstractmethod
    def update_and_attend(self, state: CacheState, q: Float[Array, "B T Hq D"],
                          k: Float[Array, "B T Hkv D"], v: Float[Array, "B T Hkv D"], *,
                          start: Int[Array, "B"], n_new: Int[Array, "B"],
                          window: int | None) -> tuple[Array, CacheState]:
        """Store the chunk's K/V and return causal attention of `q` over the sequence."""

    def truncate(self, state: CacheState, lengths: Int[Array, "B"]) -> CacheState:
        """Forget entries at positions >= lengths[b] (a rollback). Position-addressed
        layouts mask by length on every read already, so they return `state` as it is."""
        return state

    def leading_slots(self, state: CacheState, n: int) -> CacheState | None:
        """The state cut to its first `n` token slots, or None if the layout cannot cut
        it. A prefill piece whose rows end before slot n reads no later slot (all masked),
        so it can attend over this cut instead of the whole capacity and skip the masked
        key blocks; `with_leading_slots` puts the result back."""
        return None

    def with_leading_slots(self, state: CacheState, part: CacheState) -> CacheState:
        """`state` with its first slots replaced by `part` (from `leading_slots`)."""
        raise NotImplementedError(f"{type(self).__name__} does not cut its state")

    def capacity(self, max_len: int) -> int:
        """How many positions a sequence may reach (a window cache never fills up)."""
        return max_len

    def describe(self) -> str:
        return type(self).__name__


def write_positions(start: Int[Array, "B"], n_new: Int[Array, "B"], t: int,
                    n_slots: int) -> Int[Array, "B T"]:
    """Absolute slot of each chunk token; padding tokens map to `n_slots` (dropped on scatter)."""
    idx = start[:, None] + jnp.arange(t)[None, :]
    return jnp.where(jnp.arange(t)[None, :] < n_new[:, None], idx, n_slots)


def lookback_positions(start: Int[Array, "B"], lookback: int) -> Int[Array, "B L"]:
    """The `lookback` positions before each row's chunk (KVCodec.lookback; negative ones
    included, the codec ignores them)."""
    return start[:, None] - lookback + jnp.arange(lookback)[None, :]


def take_tokens(buf: Array, slots: Int[Array, "B L"]) -> Array:
    """buf[b, slots[b, l]] (slots clipped into the buffer: callers mask what they read)."""
    b_idx = jnp.broadcast_to(jnp.arange(buf.shape[0])[:, None], slots.shape)
    return buf[b_idx, jnp.clip(slots, 0, buf.shape[1] - 1)]


def scatter_tokens(buf: Array, slots: Int[Array, "B T"], values: Array) -> Array:
    """buf[b, slots[b, t]] = values[b, t]; out-of-range slots are dropped."""
    b_idx = jnp.broadcast_to(jnp.arange(buf.shape[0])[:, None], slots.shape)
    return buf.at[b_idx, slots].set(values.astype(buf.dtype), mode="drop")


def state_nbytes(state: CacheState) -> int:
    """Bytes of all arrays in a cache state (works on real arrays and ShapeDtypeStructs)."""
    return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))


def check_codec(codec) -> None:
    """Layouts take a KVCodec (research/kv/codec.py); name what was given instead."""
    from research.kv.codec import KVCodec  # codec.py imports this module
    if not isinstance(codec, KVCodec):
        raise TypeError(f"codec must be a KVCodec (e.g. FloatCodec('bfloat16')), got "
                        f"{type(codec).__name__}: {codec!r}")


def poison_rows(out: Float[Array, "B T H D"], bad_rows: Array | None) -> Array:
    """NaN for rows whose K/V a lossy codec could not represent (never a silent junk code)."""
    if bad_rows is None:
        return out
    return jnp.where(bad_rows[:, None, None, None], jnp.nan, out)
