"""Measured wall cost of one speculative step per draft length (drives the adaptive policy).

A step with k drafted tokens runs the drafter and a target forward of T = k + 1 tokens.
How that time grows with k depends on the hardware: memory-bound accelerators verify
several tokens for nearly the price of one, a small CPU may not. So the policy takes
measured costs instead of assuming; this times each branch of the decode loop as it is
compiled there (same function, cache buffers donated as in the loop), round-robin over k
so load drift on a shared machine hits every k alike, and reports medians.
"""
from __future__ import annotations

import functools
import statistics
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from research.core.timing import time_interleaved
from research.model.llama import Model
from research.decode.generate import prefill
from research.decode.sampling import SamplingConfig
from research.specdecode.drafters import DraftContext, Drafter
from research.specdecode.generate import _verify_branch
from research.specdecode.rollback import with_rollback_slack


def measure_step_costs(model: Model, drafter: Drafter, draft_lengths: Sequence[int], *,
                       batch: int = 1, max_len: int = 512, context: int | None = None,
                       sampling: SamplingConfig = SamplingConfig(), repeats: int = 7,
                       seed: int = 0) -> dict:
    """Median seconds of one decode step per k; returns {"k", "median_s", "relative"}.

    The context is a repeated random pattern of `context` tokens (default max_len // 2),
    so a lookup drafter finds full-length drafts and every row verifies k tokens.
    `relative` (cost / cost at the smallest k) is what `DraftLengthPolicy.costs` takes.
    """
    ks = tuple(int(k) for k in draft_lengths)
    if not ks or any(k < 0 for k in ks):
        raise ValueError(f"draft_lengths must be non-negative ints, got {draft_lengths}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    context = context or max_len // 2
    if not 2 <= context <= max_len - max(ks) - 2:
        raise ValueError(f"context must be in [2, max_len - max(k) - 2], got {context}")
    model = with_rollback_slack(model, max(ks))
    rng = np.random.default_rng(seed)
    pattern = rng.integers(0, model.config.vocab_size, 32)
    prompt = np.resize(pattern, context - 1).astype(np.int32)
    tokens = jnp.asarray(np.tile(prompt, (batch, 1)))
    lengths = jnp.full((batch,), context - 1, jnp.int32)
    _, caches = prefill(model, tokens, lengths, model.init_cache(batch, max_len))
    dstate = drafter.prefill(drafter.init(model, batch, max_len, max(ks)), model, tokens, lengths)
    history = np.zeros((batch, max_len + max(ks) + 2), np.int32)
    history[:, :context] = np.resize(pattern, context)
    ctx = DraftContext(jnp.asarray(history), jnp.full((batch,), context, jnp.int32),
                       jnp.ones((batch,), bool))
    fns = {k: jax.jit(_verify_branch(k, target=model, drafter=drafter, sampling=sampling,
                                     max_draft=max(ks)), donate_argnums=(0,)) for k in ks}
    key = jax.random.key(seed)
    box = [caches]  # the donated cache buffers pass from step to step, as in the loop

    def step(k):
        out = fns[k](box[0], dstate, ctx, jnp.full((batch,), k, jnp.int32), key)
        box[0] = out.caches
        return out

    # one warm-up round compiles every branch
    times = time_interleaved({k: functools.partial(step, k) for k in ks}, warmup=1,
                             repeats=repeats)
    med = [statistics.median(times[k]["wall_s"]) for k in ks]
    rel = [m / med[0] for m in med]
    return {"k": list(ks), "median_s": med, "relative": rel,
            "linear_fit": linear_cost_fit(ks, rel), "batch": batch, "max_len": max_len}


def linear_cost_fit(ks: Sequence[int], relative: Sequence[float]) -> list[float]:
    """Least-squares 1 + slope * k through the measured relative costs (slope >= 0).

    On a noisy shared machine single medians jump around; the fitted line keeps the
    policy's choices stable while following the measured growth with k."""
    ks = np.asarray(ks, np.float64)
    rel = np.asarray(relative, np.float64)
    denom = float(np.sum(ks * ks))
    slope = max(float(np.sum(ks * (rel - 1.0))) / denom, 0.0) if denom else 0.0
    return [1.0 + slope * float(k) for k in ks]
