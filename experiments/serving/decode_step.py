"""Timing the whole-model decode step of paged KV caches at a long context, per codec.

The step the engine runs for its decode rows (`forward` of one token per row, caches
donated, pages of `block_size`), without the engine's scheduler around it. Decode time
does not depend on what the cache holds, so the caches stay as `init_cache` made them
(no long prefill). Used by scripts/bench_decode_step_long.py and the codec frontier
(experiments/serving/frontier.py).
"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from research.core.timing import time_interleaved
from research.kv.paged import paged_kv_cache
from research.model import forward


def _donating(step, model, states):
    """A decode step on the cache states the last step returned (they are donated)."""
    held = [states]

    def call():
        out = step(model, held[0])
        held[0] = out.cache_states
        return out.logits
    return call


def decode_step(model, rows: int, context: int, block_size: int = 16, paged: bool = True):
    """A callable running one jitted decode step of `rows` rows at position `context`
    through `model`'s caches, laid out in pages of `block_size` (`paged`) or dense as
    `generate` keeps them."""
    if rows < 1 or context < 1:
        raise ValueError(f"rows and context must be >= 1, got {rows}, {context}")
    m = paged_kv_cache(block_size=block_size).apply(model, ()) if paged else model
    tokens = jnp.full((rows, 1), 42, jnp.int32)
    start = jnp.full((rows,), context, jnp.int32)
    step = jax.jit(lambda m, states: forward(m, tokens, cache_states=states, start=start,
                                             logits="last"), donate_argnums=1)
    return _donating(step, m, m.init_cache(rows, context + block_size))


def time_decode_steps(steps: dict, repeats: int) -> tuple[dict, dict]:
    """(median seconds per call, first-call seconds) of each named step callable: each is
    warmed once (its compile counted apart), then timed `repeats` times, rounds
    interleaved across the steps (so drift on a shared machine hits every side)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    first = {}
    for name, fn in steps.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        first[name] = time.perf_counter() - t0
    times = time_interleaved(steps, warmup=0, repeats=repeats, alternate=True)
    return {n: statistics.median(t["wall_s"]) for n, t in times.items()}, first
