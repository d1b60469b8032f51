"""PatchKV's memory account: does a patch pay for itself?

A patched press serves a context from its kept KV plus the patch it stores for that
context; the alternatives are the full cache or a larger budget of the press alone. With
the kept KV linear in the context length n (an eviction press keeps a fixed fraction) and
a patch whose bytes do not depend on n (a rank-capped patch: factors of fixed shapes),

    kept_pt * n + patch_bytes  <  other_pt * n   for   n  >  patch_bytes / (other_pt - kept_pt)

where *_pt are bytes per context token. `break_even_tokens` gives that n. Every byte
count comes from real arrays: `cache_nbytes` sums a cache's arrays (cast to another dtype,
e.g. bfloat16, as real cast arrays) and `research.patchkv.patch_nbytes` a patch's.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from research.kv.base import state_nbytes


def cast_states(states: tuple, dtype) -> tuple:
    """Cache states with every floating-point array cast to `dtype` (integer slot counters
    and positions unchanged): the same cache stored at another precision."""
    def cast(a):
        return a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a
    return jax.tree.map(cast, states)


def cache_nbytes(states: tuple, dtype=None) -> int:
    """Bytes of a cache's arrays as given (dtype None) or cast to `dtype`."""
    return int(state_nbytes(states if dtype is None else cast_states(states, dtype)))


def per_token_bytes(nbytes: int, n_tokens: int) -> float:
    """Bytes per context token of a cache measured on an `n_tokens`-token context."""
    if not (isinstance(n_tokens, int) and n_tokens >= 1):
        raise ValueError(f"n_tokens must be an int >= 1, got {n_tokens!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return nbytes / n_tokens


def break_even_tokens(patch_bytes: int, kept_per_token: float,
                      other_per_token: float) -> float:
    """The context length above which kept KV + patch takes fewer bytes than the other
    cache (the full one, or a larger budget): patch_bytes / (other - kept) per token.
    0 for no patch; inf when the press keeps at least as many bytes per token as the
    other cache (the patch never pays for itself)."""
    if patch_bytes < 0 or kept_per_token < 0 or other_per_token < 0:
        raise ValueError(f"byte counts must be >= 0, got {patch_bytes=}, "
                         f"{kept_per_token=}, {other_per_token=}")
    if patch_bytes == 0:
        return 0.0
    saved = other_per_token - kept_per_token
    return patch_bytes / saved if saved > 0 else math.inf
