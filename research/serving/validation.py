"""What the engine checks before it accepts a request (defence in depth: the server
validates first): a `RequestError` naming the field, else the request's `LiveRequest`."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from research.decode.sampling import sampling_bound
from research.serving.api import MAX_LOGPROBS, Request, RequestError, SamplingParams
from research.serving.engine_state import LiveRequest
from research.serving.text_stream import TextStream


def live_request(request: Request, *, tokenizer, vocab_size: int, max_len: int,
                 stop_token_ids: Sequence[int], taken: bool) -> LiveRequest:
    """`request` checked against the engine (vocabulary, max_len; `taken`: its id is
    already queued or running) as a new `LiveRequest`."""
    if not isinstance(request, Request):
        raise RequestError("request", f"expected a Request, got {type(request).__name__}")
    rid = request.request_id
    if not isinstance(rid, str) or not rid:
        raise RequestError("request_id", f"must be a non-empty string, got {rid!r}")
    if taken:
        raise RequestError("request_id", f"{rid!r} is already queued or running")
    if not isinstance(request.params, SamplingParams):
        raise RequestError("params", f"expected SamplingParams, got "
                                     f"{type(request.params).__name__}")
    ids = request.prompt_ids
    if not ids:
        raise RequestError("prompt", "is empty: at least one token is needed")
    if not all(isinstance(t, (int, np.integer)) and 0 <= t < vocab_size for t in ids):
        raise RequestError("prompt", f"token ids must be integers in [0, {vocab_size})")
    p = request.params
    if len(ids) >= max_len:
        raise RequestError("prompt", f"{len(ids)} tokens; the engine serves at most "
                                     f"max_len - 1 = {max_len - 1} prompt tokens")
    if len(ids) + p.max_new_tokens > max_len:
        raise RequestError("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens "
                                         f"({p.max_new_tokens}) exceeds max_len={max_len}")
    if not all(isinstance(s, str) and s for s in p.stop):
        raise RequestError("stop", f"stop strings must be non-empty strings, got {p.stop!r}")
    if not all(isinstance(t, (int, np.integer)) and 0 <= t < vocab_size
               for t in p.stop_token_ids):
        raise RequestError("stop_token_ids", f"must be integers in [0, {vocab_size})")
    if not all(0 <= t < vocab_size for t, _ in p.logit_bias):
        raise RequestError("logit_bias", f"token ids must be integers in [0, {vocab_size})")
    bound = sampling_bound("top_k", p.top_k, vocab_size=vocab_size)
    if bound is not None:
        raise RequestError("top_k", f"{bound}, got {p.top_k}")
    tokens = [int(t) for t in ids]
    req = LiveRequest(request, tokens, len(tokens), TextStream(tokenizer, p.stop),
                      frozenset(tuple(stop_token_ids) + tuple(int(t) for t in p.stop_token_ids)))
    if p.prompt_logprobs is not None:
        n = len(tokens)
        req.prompt_lp = np.full(n, np.nan, np.float32)
        req.prompt_top_ids = np.zeros((n, MAX_LOGPROBS), np.int32)
        req.prompt_top_lp = np.full((n, MAX_LOGPROBS), np.nan, np.float32)
    return req
