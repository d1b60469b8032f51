"""One context, many queries: prefill a context once, then serve queries over its cache.

The context's cache is built once by the *incoming* model (the one whose caches compress,
e.g. `evict(...)`); queries (continuations scored by teacher forcing, questions answered
by greedy decoding) then run over that cache with any model that shares its caches, e.g.
the PatchKV-patched one. Context tokens therefore never see the patch: the patch only
changes how later queries read the compressed context (see research/patchkv/patch.py).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from research.model.llama import Model, forward
from research.decode import generate as gen


BUCKET = 64  # context chunks and caches are padded to a multiple of this (fewer compiles)


class ContextCache(NamedTuple):
    states: tuple  # per-layer cache states, batch 1
    length: int  # context tokens
    last_logits: jax.Array  # [1, V] after the last context token


@jax.jit
def _prefill(model: Model, tokens, lengths, states):
    out = forward(model, tokens, cache_states=states, n_new=lengths, logits="last")
    return out.logits, out.cache_states


def prefill_batch(model: Model, tokens, lengths, max_len: int):
    """Prefill right-padded contexts [B, T] into fresh caches of at least `max_len` slots.

    The chunk and the cache are padded up to multiples of BUCKET tokens, so contexts of
    nearby lengths share one compiled program.
    """
    tokens = np.asarray(tokens, np.int32)
    lengths = np.asarray(lengths, np.int32)
    if tokens.ndim != 2 or lengths.shape != (tokens.shape[0],):
        raise ValueError(f"tokens must be [B, T] with lengths [B], got {tokens.shape=} "
                         f"{lengths.shape=}")
    if lengths.min() < 1:
        raise ValueError("every context needs at least one token (got an empty context)")
    if lengths.max() > max_len:
        raise ValueError(f"context of {int(lengths.max())} tokens exceeds {max_len=}")
    padded = np.zeros((tokens.shape[0], gen.round_up(tokens.shape[1], BUCKET)), np.int32)
    padded[:, :tokens.shape[1]] = tokens
    states = model.init_cache(tokens.shape[0], gen.round_up(max_len, BUCKET))
    return _prefill(model, jnp.asarray(padded), jnp.asarray(lengths), states)


def prefill_context(model: Model, context: Sequence[int], max_len: int) -> ContextCache:
    ids = np.asarray(context, np.int32)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"context must be a non-empty 1-D token sequence, got {ids.shape=}")
    logits, states = prefill_batch(model, ids[None], [ids.size], max_len)
    return ContextCache(states, int(ids.size), logits)


def tile_states(states: tuple, index) -> tuple:
    """Gather batch rows `index` of every state leaf (each query row gets its context)."""
    index = jnp.asarray(index, jnp.int32)

    def take(a):
        return jnp.take(a, index, axis=0)

    batch = {int(a.shape[0]) for a in jax.tree.leaves(states) if a.ndim}
    if len(batch) != 1:
        raise ValueError(f"cache states must share one leading batch dim, found {batch}")
    return jax.tree.map(take, states)


def pad_rows(rows: Sequence[Sequence[int]], bucket: int = 16) -> tuple[np.ndarray, np.ndarray]:
    if not rows:
        raise ValueError("need at least one query row")
    lengths = np.array([len(r) for r in rows], np.int32)
    if lengths.min() < 1:
        raise ValueError("every query row needs at least one token")
    out = np.zeros((len(rows), gen.round_up(int(lengths.max()), bucket)), np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out, lengths


@functools.partial(jax.jit, static_argnames=("capture",))
def query_forward(model, tokens, start, n_new, states, capture=False):
    out = forward(model, tokens, cache_states=states, start=start, n_new=n_new,
                  capture=capture)
    attn = None if not capture else tuple(c["attn"] for c in out.captures)
    return out.logits, attn


class ContinuationScore(NamedTuple):
    nll: float  # mean NLL (nats/token) over the scored targets of all continuations
    n_tokens: int
    per_row_nll: np.ndarray  # [Q]
    attn_contrib: tuple | None  # per layer o @ W_o of the queries [Q, m, D] (when asked)


def score_continuations(model: Model, ctx: ContextCache, continuations: np.ndarray, *,
                        attention: bool = False) -> ContinuationScore:
    """Teacher-forced NLL of each continuation row placed right after the context.

    Targets are continuation tokens 1..m-1 (token 0 is predicted by the prefill, which a
    compressed cache does not change for eviction, so it is left out for every method).
    attention=True also returns each layer's attention contribution (o @ wo) for
    attention-output error against a reference.
    """
    conts = np.asarray(continuations, np.int32)
    if conts.ndim != 2 or conts.shape[1] < 2:
        raise ValueError(f"continuations must be [Q, m>=2] token ids, got {conts.shape}")
    q, m = conts.shape
    states = tile_states(ctx.states, np.zeros(q, np.int32))
    start = jnp.full((q,), ctx.length, jnp.int32)
    logits, attn = query_forward(model, jnp.asarray(conts), start, jnp.full((q,), m),
                                  states, capture=attention)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, jnp.asarray(conts)[:, 1:, None], axis=-1)[..., 0]
    per_row = np.asarray(jnp.mean(nll, axis=1))
    contrib = None
    if attention:
        contrib = tuple(a @ model.params["layers"][i]["wo"] for i, a in enumerate(attn))
    return ContinuationScore(float(np.mean(per_row)), q * (m - 1), per_row, contrib)


def attention_error(candidate: tuple, reference: tuple) -> float:
    """Mean over layers of the relative Frobenius error of attention contributions."""
    errs = [float(jnp.linalg.norm(c - r) / jnp.maximum(jnp.linalg.norm(r), 1e-30))
            for c, r in zip(candidate, reference)]
    return float(np.mean(errs))


def decode_flops(model: Model, states: tuple, lengths: Sequence[int]) -> float:
    """XLA cost-analysis FLOPs of `model`'s compiled decode step for one new token per
    cache row (`lengths`: tokens already in each row of `states`). A patch that costs
    nothing per query leaves this number unchanged."""
    b = len(lengths)
    args = (jnp.zeros((b,), jnp.int32), jnp.asarray(lengths, jnp.int32),
            jnp.ones((b,), bool), states)
    cost = gen.decode_step.lower(model, *args).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


def param_shapes(model: Model):
    """(shape, dtype name) of every parameter, as a pytree (equal for a folded patch)."""
    return jax.tree.map(lambda x: (x.shape, str(x.dtype)), model.params)


def answer_queries(model: Model, ctx: ContextCache, queries: Sequence[Sequence[int]], *,
                   max_new_tokens: int, stop_tokens: Sequence[int] = ()) -> list[list[int]]:
    """Greedy answers to each query (a token suffix appended after the context)."""
    tokens, lengths = pad_rows(queries)
    q = len(queries)
    states = tile_states(ctx.states, np.zeros(q, np.int32))
    start = jnp.full((q,), ctx.length, jnp.int32)
    logits, states = append_queries(model, jnp.asarray(tokens), start, jnp.asarray(lengths),
                                     states)
    decoded = gen.decode_loop(
        model, logits, start + jnp.asarray(lengths), states, jax.random.key(0),
        max_new_tokens=max_new_tokens, sampling=gen.SamplingConfig(),
        stop_tokens=tuple(int(t) for t in stop_tokens))
    gen.raise_if_nonfinite(decoded, model.config.n_layers)
    out, n_out, done = (np.asarray(a) for a in decoded[:3])
    return [list(map(int, out[i, :n_out[i] - int(done[i])])) for i in range(q)]


@jax.jit
def append_queries(model, tokens, start, n_new, states):
    """Right-padded token rows [B, m] (n_new real each) appended at `start` over `states`:
    (logits after each row's last token [B, V], the extended states)."""
    out = forward(model, tokens, cache_states=states, start=start, n_new=n_new, logits="last")
    return out.logits, out.cache_states
