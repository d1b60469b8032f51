"""The engine's device calls: one forward over a batch of rows through the paged pool,
the sampled tokens back on the host (`StepRunner`), and the jitted programs it runs
(`serve_forward`, and `serve_forward_ext` for scoring / logprobs / logit processors).

The host builds the rows (tokens, positions, block table, per-row sampling arrays); the
runner picks the phase's model view (Model.for_phase: a research.dynacore model prefills
with its prefill weights and decodes with its decode weights), runs the one call, waits
for its outputs and counts the time and the KV slots read (`StepStats`).
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from research.decode.paged_pool import PagedPool
from research.decode.sampling import process_logits, sample_per_row
from research.kv import paged
from research.model.llama import Model, forward
from research.serving.api import MAX_LOGPROBS
from research.serving.engine_state import StepStats

PHASES = ("prefill", "decode")
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = [0]
_listening = [False]


def _on_event(event: str, duration: float, **_) -> None:
    if event == _COMPILE_EVENT:
        _compiles[0] += 1


def compile_count() -> int:
    """XLA backend compiles in this process since the first engine was built."""
    if not _listening[0]:
        jax.monitoring.register_event_duration_secs_listener(_on_event)
        _listening[0] = True
    return _compiles[0]


class StepRunner:
    """Runs the forward calls of the engine's steps over `pool` (see the module
    docstring). min_read_len: the smallest read bucket in tokens (block tables are as
    wide as a pass's longest row rounded up to a power of two of blocks, at least this)."""

    def __init__(self, pool: PagedPool, *, min_read_len: int):
        self.pool = pool
        self.phase_models = {phase: pool.model.for_phase(phase) for phase in PHASES}
        self.min_table_blocks = -(-min_read_len // pool.block_size)
        self.stats = StepStats()

    def table_widths(self) -> list[int]:
        """Block-table widths a pass may use (every one is compiled by warm-up)."""
        return self.pool.table_widths(self.min_table_blocks)

    def table_width(self, n_blocks: int) -> int:
        """The width of a pass whose longest row holds `n_blocks` blocks."""
        return self.pool.table_width(n_blocks, self.min_table_blocks)

    def run(self, tokens, start, n_new, table, sampling, *, verify: bool, phase: str):
        """`serve_forward` over the rows; sampling = (temperature, top_k, top_p, keys)
        per row. Returns (sampled [R], greedy [R, T] or [R, 1]) on the host."""
        self.stats.read_slots += table.size * self.pool.block_size
        t0 = time.perf_counter()
        tables = self.pool.pass_tables(table, start, n_new)
        self.pool.pools, sampled, greedy = serve_forward(
            self.phase_models[phase], self.pool.pools, tables, tokens, start, n_new,
            *sampling, verify=verify)
        sampled, greedy = np.asarray(sampled), np.asarray(greedy)
        self.stats.forward_s += time.perf_counter() - t0
        return sampled, greedy

    def run_ext(self, tokens, start, n_new, table, sampling, targets, proc, *, phase: str,
                score: bool) -> tuple:
        """`serve_forward_ext` over the rows; returns its outputs as host arrays."""
        self.stats.read_slots += table.size * self.pool.block_size
        t0 = time.perf_counter()
        tables = self.pool.pass_tables(table, start, n_new)
        self.pool.pools, out = serve_forward_ext(
            self.phase_models[phase], self.pool.pools, tables, tokens, start, n_new,
            *sampling, targets, proc, score=score)
        out = tuple(np.asarray(x) for x in jax.device_get(out))
        self.stats.forward_s += time.perf_counter() - t0
        return out


def as_tables(tables) -> dict:
    """{state key: table} of a pass (a bare array is the block table)."""
    return tables if isinstance(tables, dict) else {paged.TABLE: tables}


@functools.partial(jax.jit, static_argnames=("verify",), donate_argnums=(1,))
def serve_forward(model: Model, pools: tuple, tables, tokens, start, n_new, temperature,
                   top_k, top_p, key_data, *, verify: bool):
    """Rows' pending tokens through the paged caches; the token after each row's last
    real one, sampled with the row's settings; `verify` also returns the argmax at every
    position (speculative verification), else [R, 1] argmax at the last. tables: the
    block table [R, M], or the pass's tables by state key (`PagedPool.pass_tables`)."""
    states = tuple({**p, **as_tables(tables)} for p in pools)
    out = forward(model, tokens, cache_states=states, start=start, n_new=n_new,
                  logits="all" if verify else "last")
    new_pools = tuple(paged.pools_of(s) for s in out.cache_states)
    if verify:
        last = out.logits[jnp.arange(tokens.shape[0]), jnp.maximum(n_new - 1, 0)]
        greedy = jnp.argmax(out.logits, axis=-1).astype(jnp.int32)
    else:
        last = out.logits
        greedy = jnp.argmax(last, axis=-1).astype(jnp.int32)[:, None]
    return new_pools, sample_per_row(last, temperature, top_k, top_p, key_data), greedy


@functools.partial(jax.jit, static_argnames=("score",), donate_argnums=(1,))
def serve_forward_ext(model: Model, pools: tuple, tables, tokens, start, n_new, temperature,
                      top_k, top_p, key_data, targets, proc, *, score: bool):
    """`serve_forward` for scoring, logprobs and logit processors (never speculative).

    proc: None, or (counts [R, V], seen [R, V], bias [R, V], presence [R], frequency [R],
    repetition [R]) for `process_logits`. Returns new pools and (sampled [R], greedy
    [R, 1], the sampled token's raw logprob [R], top MAX_LOGPROBS ids / logprobs [R, K]),
    plus with `score` (logprob of `targets` [R, T] at every position, top ids / logprobs
    [R, T, K]). Logprobs are of the model's raw distribution (before processors)."""
    states = tuple({**p, **as_tables(tables)} for p in pools)
    out = forward(model, tokens, cache_states=states, start=start, n_new=n_new,
                  logits="all" if score else "last")
    new_pools = tuple(paged.pools_of(s) for s in out.cache_states)
    rows = jnp.arange(tokens.shape[0])
    last = out.logits[rows, jnp.maximum(n_new - 1, 0)] if score else out.logits
    logits = last if proc is None else process_logits(last, *proc)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None]
    sampled = sample_per_row(logits, temperature, top_k, top_p, key_data)
    raw = jax.nn.log_softmax(last.astype(jnp.float32), axis=-1)
    top_lp, top_ids = jax.lax.top_k(raw, MAX_LOGPROBS)
    result = (sampled, greedy, raw[rows, sampled], top_ids.astype(jnp.int32), top_lp)
    if score:
        all_lp = jax.nn.log_softmax(out.logits.astype(jnp.float32), axis=-1)
        tgt = jnp.take_along_axis(all_lp, targets[..., None], axis=-1)[..., 0]
        pos_lp, pos_ids = jax.lax.top_k(all_lp, MAX_LOGPROBS)
        result += (tgt, pos_ids.astype(jnp.int32), pos_lp)
    return new_pools, result
