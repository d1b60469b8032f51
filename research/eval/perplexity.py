"""Sliding-window perplexity through the model's own KV cache.

Each window is prefilled through `model.caches`, so a cache codec (quantised, evicting,
...) changes the attention the scored tokens see, exactly as in serving. Windows advance
by `stride`; a window scores only the tokens no earlier window scored, each with up to
`window - stride` tokens of context (the Hugging Face recipe).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from research.model.llama import Model, forward


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


def perplexity(model: Model, token_ids: Sequence[int], *, window: int = 512,
               stride: int | None = None, batch_size: int = 4,
               max_windows: int | None = None, progress: bool = False) -> Perplexity:
    """Perplexity of `token_ids` under `model`, in batches of windows."""
    ids = np.asarray(token_ids, np.int32)
    stride = stride or window // 2
    wins = windows(len(ids), window, stride)[:max_windows]
    total_nll, total_n = 0.0, 0
    batches = range(0, len(wins), batch_size)
    for i in tqdm(batches, desc="perplexity", disable=not progress):
        chunk = wins[i:i + batch_size]
        tokens = np.zeros((batch_size, window), np.int32)
        lengths = np.zeros((batch_size,), np.int32)
        score_from = np.full((batch_size,), window, np.int32)
        for r, w in enumerate(chunk):
            tokens[r, :w.end - w.begin] = ids[w.begin:w.end]
            lengths[r] = w.end - w.begin
            score_from[r] = w.end - w.begin - w.n_scored
        lengths_for_model = np.maximum(lengths, 1)  # empty filler rows score nothing
        states = model.init_cache(batch_size, window)
        nll, n = _window_nll(model, jnp.asarray(tokens), jnp.asarray(lengths_for_model),
                             jnp.asarray(score_from), states)
        total_nll += float(jnp.sum(nll))
        total_n += int(jnp.sum(n))
    if total_n == 0:
        raise ValueError("no tokens were scored")
    mean = total_nll / total_n
    if not math.isfinite(mean):
        raise FloatingPointError(f"perplexity is not finite (mean NLL {mean})")
    return Perplexity(math.exp(mean), mean, total_n)
