"""KV memory accounting from the cache arrays themselves.

`jax.eval_shape(model.init_cache)` yields exactly the shapes and dtypes the real arrays
get (a test checks it against real allocations), so large contexts are accounted for
without allocating them.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax

from research.kv.base import state_nbytes

if TYPE_CHECKING:  # type-only: research.model depends on research.kv, not the reverse
    from research.model.llama import Model

GiB = 1024 ** 3


def kv_cache_bytes(model: Model, batch: int, max_len: int) -> int:
    """Bytes of all cache arrays for `batch` sequences of `max_len` tokens (all layers)."""
    shapes = jax.eval_shape(functools.partial(model.init_cache, batch, max_len))
    return state_nbytes(shapes)


def kv_bytes_per_token(model: Model, context: int) -> float:
    """Cache bytes per token of one sequence at `context` tokens (window layers amortise)."""
    return kv_cache_bytes(model, 1, context) / context


def max_batch(model: Model, budget_bytes: int, context: int) -> int:
    """Most sequences of `context` tokens whose KV cache fits in `budget_bytes`."""
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
    one, two = kv_cache_bytes(model, 1, context), kv_cache_bytes(model, 2, context)
    per_seq = two - one
    fixed = one - per_seq  # batch-independent arrays (e.g. shared codebooks)
    return max(0, (budget_bytes - fixed) // per_seq)
