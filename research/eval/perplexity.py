"""Sliding-window perplexity through the model's own KV cache.

Each window is prefilled through `model.caches`, so a cache codec (quantised, evicting,
...) changes the attention the scored tokens see, exactly as in serving. Windows advance
by `stride`; a window scores only the tokens no earlier window scored, each with up to
`window - stride` tokens of context (the Hugging Face recipe).

Windows longer than `chunk` tokens are prefilled and scored in pieces of `chunk`
(each piece reads what the earlier ones wrote, as serving's chunked prefill does): one
forward over a whole 8k window would hold scores of window x window per head and row.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from research.model.llama import Model, forward, forward_live


class Perplexity(NamedTuple):
    ppl: float
    nll: float  # mean negative log-likelihood (nats per token)
    n_tokens: int


class Window(NamedTuple):
    begin: int
    end: int
    n_scored: int  # the last n_scored targets of the window are scored


def windows(n_tokens: int, window: int, stride: int) -> list[Window]:
    if window < 2:
        raise ValueError(f"window must be >= 2, got {window}")
    if not 1 <= stride < window:  # windows must overlap so each target has its context
        raise ValueError(f"stride must be in [1, window={window}), got {stride}")
    if n_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score, got {n_tokens}")
    out, prev_end, begin = [], 0, 0
    while prev_end < n_tokens:
        end = min(begin + window, n_tokens)
        n_scored = end - max(prev_end, begin + 1)  # the first token of a window has no target
        out.append(Window(begin, end, n_scored))
        prev_end, begin = end, begin + stride
    return out


@jax.jit
def _window_nll(model: Model, tokens, lengths, score_from, cache_states):
    """Sum of target NLL and count per row: targets tokens[:, 1:], scored at >= score_from."""
    logits = forward(model, tokens, cache_states=cache_states, n_new=lengths).logits
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    target = tokens[:, 1:]
    nll = -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    t = jnp.arange(1, tokens.shape[1])[None, :]
    scored = (t >= score_from[:, None]) & (t < lengths[:, None])
    return jnp.sum(jnp.where(scored, nll, 0.0), axis=1), jnp.sum(scored, axis=1)


@functools.partial(jax.jit, static_argnames=("live", "score"))
def _scored_piece(model: Model, piece, start, n_new, cache_states, score_args, *,
                  live=None, score):
    """One piece of a batch of windows through `model`'s caches: (score(logits [b, chunk, V],
    start, *score_args), the cache states after writing it). live: attend over the first
    `live` slots only (`Model.live_slots`; None: all)."""
    out = forward_live(model, piece, cache_states=cache_states, live=live, start=start,
                       n_new=n_new)
    return score(out.logits, start, *score_args), out.cache_states


def _no_score(logits, start):
    return ()  # a prefill-only piece: its logits are unused, so XLA drops the LM head


def scored_pieces(model: Model, tokens, lengths, states, chunk: int, score,
                  args_of=lambda c0, width: (), prefill_until: int = 0):
    """Prefill right-padded windows `tokens` [b, t] (row lengths `lengths`) through `model`'s
    caches in pieces of `chunk` tokens (module docstring), yielding per piece (c0, score's
    output): `score(logits, start, *args_of(c0, width))` runs jitted beside the forward
    (a module-level function: it is a static argument), so a piece's logits never leave
    the device unless the score returns them. Pieces ending by position `prefill_until`
    are only prefilled (no LM head, nothing yielded). The chunked-scoring loop of every
    metric here (perplexity, research.eval.divergence)."""
    b, t = tokens.shape
    for c0 in range(0, t, chunk):
        width = min(chunk, t - c0)
        piece = np.zeros((b, chunk), np.int32)
        piece[:, :width] = tokens[:, c0:c0 + width]
        n_new = np.clip(lengths - c0, 0, chunk).astype(np.int32)
        prefill_only = c0 + chunk <= prefill_until
        out, states = _scored_piece(model, jnp.asarray(piece), jnp.full((b,), c0, jnp.int32),
                                    jnp.asarray(n_new), states,
                                    () if prefill_only else args_of(c0, width),
                                    live=model.live_slots(states, c0 + chunk, chunk),
                                    score=_no_score if prefill_only else score)
        if not prefill_only:
            yield c0, out


def _nll_score(logits, start, targets, score_from, lengths):
    """Sum of NLL and count per row of the targets a piece predicts (position p predicts
    targets[:, p - start]; scored at score_from <= p + 1 < lengths)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    t = start[:, None] + 1 + jnp.arange(logits.shape[1])[None, :]  # the target's position
    scored = (t >= score_from[:, None]) & (t < lengths[:, None])
    return jnp.sum(jnp.where(scored, nll, 0.0), axis=1), jnp.sum(scored, axis=1)


def _chunked_nll(model: Model, tokens, lengths, score_from, states, chunk: int):
    """`_window_nll` in pieces of `chunk` tokens (module docstring)."""
    b, t = tokens.shape
    targets = np.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]

    def args_of(c0, width):
        tgt = np.zeros((b, chunk), np.int32)
        tgt[:, :width] = targets[:, c0:c0 + width]
        return jnp.asarray(tgt), jnp.asarray(score_from), jnp.asarray(lengths)

    total, count = 0.0, 0
    # a piece whose positions all predict targets before score_from scores nothing
    for _, (nll, n) in scored_pieces(model, tokens, lengths, states, chunk, _nll_score,
                                     args_of, prefill_until=int(np.min(score_from)) - 1):
        total += float(jnp.sum(nll))
        count += int(jnp.sum(n))
    return total, count


def perplexity(model: Model, token_ids: Sequence[int], *, window: int = 512,
               stride: int | None = None, batch_size: int = 4,
               max_windows: int | None = None, progress: bool = False,
               chunk: int = 512) -> Perplexity:
    """Perplexity of `token_ids` under `model`, in batches of windows; windows longer than
    `chunk` are prefilled and scored in pieces (module docstring)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    ids = np.asarray(token_ids, np.int32)
    stride = stride or window // 2
    wins = windows(len(ids), window, stride)[:max_windows]
    total_nll, total_n = 0.0, 0
    batches = range(0, len(wins), batch_size)
    for i in tqdm(batches, desc="perplexity", disable=not progress):
        batch = wins[i:i + batch_size]
        tokens = np.zeros((batch_size, window), np.int32)
        lengths = np.zeros((batch_size,), np.int32)
        score_from = np.full((batch_size,), window, np.int32)
        for r, w in enumerate(batch):
            tokens[r, :w.end - w.begin] = ids[w.begin:w.end]
            lengths[r] = w.end - w.begin
            score_from[r] = w.end - w.begin - w.n_scored
        lengths_for_model = np.maximum(lengths, 1)  # empty filler rows score nothing
        states = model.init_cache(batch_size, window)
        if window <= chunk:
            nll, n = _window_nll(model, jnp.asarray(tokens), jnp.asarray(lengths_for_model),
                                 jnp.asarray(score_from), states)
            total_nll += float(jnp.sum(nll))
            total_n += int(jnp.sum(n))
        else:
            nll, n = _chunked_nll(model, tokens, lengths_for_model, score_from, states, chunk)
            total_nll += nll
            total_n += n
    return _from_nll(total_nll, total_n)


def continuation_perplexity(model: Model, windows, n_context: int, *, batch_size: int = 2,
                            chunk: int = 512) -> Perplexity:
    """Perplexity of each window's tokens after its first `n_context` ones, given them
    (the context prefilled through `model.caches` in pieces of `chunk`, as serving does):
    the quality of a cache codec at a context length. windows: [n, L] token ids."""
    wins = np.asarray(windows, np.int32)
    if wins.ndim != 2 or not 0 < n_context < wins.shape[1]:
        raise ValueError(f"windows must be [n, L] with 0 < n_context < L, got shape "
                         f"{wins.shape} and n_context={n_context}")
    if batch_size < 1 or chunk < 1:
        raise ValueError(f"batch_size and chunk must be >= 1, got {batch_size}, {chunk}")
    total_nll, total_n = 0.0, 0
    length = wins.shape[1]
    for i in range(0, len(wins), batch_size):
        batch = wins[i:i + batch_size]
        lengths = np.full((len(batch),), length, np.int32)
        score_from = np.full((len(batch),), n_context, np.int32)
        states = model.init_cache(len(batch), length)
        nll, n = _chunked_nll(model, batch, lengths, score_from, states, chunk)
        total_nll, total_n = total_nll + nll, total_n + n
    return _from_nll(total_nll, total_n)


def _from_nll(total_nll: float, total_n: int) -> Perplexity:
    """Perplexity from a summed NLL over `total_n` scored tokens; refuses none or non-finite."""
    if total_n == 0:
        raise ValueError("no tokens were scored")
    mean = total_nll / total_n
    if not math.isfinite(mean):
        raise FloatingPointError(f"perplexity is not finite (mean NLL {mean})")
    return Perplexity(math.exp(mean), mean, total_n)
