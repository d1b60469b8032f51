"""Timing the whole-model decode step of paged KV caches at a long context, per codec.

The step the engine runs for its decode rows (`forward` of one token per row, caches
donated, pages of `block_size`), without the engine's scheduler around it, on caches
`init_cache` made (no long prefill). The time of a code-reading step does depend on the
codes: a value read adds each token's weight into its code's bin, and an all-zero cache
sends every token of a head to one bin, a chain of dependent adds (a per-group scatter
tried for SmolLM2's post-RoPE TaSQ read at batch 4 x 8k ran 2x slower on zeros than on
random codes; the shipped one-scatter read, 3% slower). So `fill_codes` (default) fills
every uint8 leaf (codes, packed int4/int8 values) with uniform random bytes: served codes
are spread out too (SmolLM2's tasq-1bit-post codes of 2,048 dev tokens: 5.5-7.5 bits of
entropy per head and group out of 8, the largest bin 2-15% of tokens). Float pools stay
zero (a dense read's time does not depend on them).
Used by scripts/bench_decode_step_long.py and the codec frontier
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


def random_codes(states, seed: int = 0):
    """`states` with every uint8 leaf replaced by uniform random bytes (module docstring)."""
    leaves, treedef = jax.tree_util.tree_flatten(states)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return treedef.unflatten([
        jax.random.randint(k, x.shape, 0, 256, jnp.int32).astype(jnp.uint8)
        if x.dtype == jnp.uint8 else x for k, x in zip(keys, leaves)])


def decode_step(model, rows: int, context: int, block_size: int = 16, paged: bool = True,
                fill_codes: bool = True):
    """A callable running one jitted decode step of `rows` rows at position `context`
    through `model`'s caches, laid out in pages of `block_size` (`paged`) or dense as
    `generate` keeps them; `fill_codes`: uint8 leaves hold random bytes, not zeros."""
    if rows < 1 or context < 1:
        raise ValueError(f"rows and context must be >= 1, got {rows}, {context}")
    m = paged_kv_cache(block_size=block_size).apply(model, ()) if paged else model
    tokens = jnp.full((rows, 1), 42, jnp.int32)
    start = jnp.full((rows,), context, jnp.int32)
    step = jax.jit(lambda m, states: forward(m, tokens, cache_states=states, start=start,
                                             logits="last"), donate_argnums=1)
    states = m.init_cache(rows, context + block_size)
    return _donating(step, m, random_codes(states) if fill_codes else states)


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
