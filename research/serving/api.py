"""The serving engine's request/response types: the contract between engine and server.

`research.serving.engine.ServingEngine` consumes `Request`s and produces `TokenEvent`s;
`research.serving.server` maps OpenAI JSON onto these types and events back onto JSON /
SSE. Neither side imports the other's internals.

Engine surface (JetStream/MaxEngine shape, plus a vLLM-style driver loop):
  engine.prefill(request) -> Prefix          # computes the prompt KV (prefix-cache aware)
  engine.insert(prefix, slot) -> None         # puts it into a decode slot
  engine.generate(state) -> (state, tokens)   # one decode step for every live slot
  engine.add_request(request) -> None         # queue; raises QueueFullError when bounded queue is full
  engine.abort(request_id) -> None            # frees the request's blocks, idempotent
  engine.step() -> list[TokenEvent]           # one scheduler iteration (prefill chunks + decode)
  engine.has_work() -> bool
  engine.metrics() -> EngineMetrics
All engine methods are called from one thread (the server's engine loop).

Event semantics (research/serving/engine.py): every request gets exactly one event with
`finish_reason` set, its last. A stop *token* ends a request with a pure finish event
(token_id None; the stop token is not output); a stop *string* or max_tokens end it on
the event of the token that completed it. `text` increments concatenate to the output
text (never a partial UTF-8 character, never a tail that may become a stop string).
`abort` queues an "abort" finish event that the next `step()` returns. A request that
fails inside a step (an exception while building its rows) ends with finish_reason
"error" and the exception's text in `error`; the engine serves the others on.
A request with `prompt_logprobs` gets its prompt's log-probabilities on its first event;
with max_new_tokens=0 that is its only event (finish "length", no token: a prefill, no
decode).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Literal

import numpy as np

from research.decode.sampling import SamplingConfig, SamplingError, check_sampling

FinishReason = Literal["stop", "length", "abort", "error"]
MAX_LOGPROBS = 20  # alternatives per token the engine can return (OpenAI chat's limit)


class QueueFullError(RuntimeError):
    """The bounded request queue is full; the server answers 429."""


class RequestError(ValueError):
    """A request the engine cannot serve; `field` names the offending field (-> HTTP 400)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; temperature 0 = greedy. Same seed -> same tokens, whatever the batch."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()  # stop strings (the text up to, not including, the stop)
    stop_token_ids: tuple[int, ...] = ()  # extra stop ids beside the model's EOS
    # log-probabilities (of the model's raw distribution, before penalties / bias /
    # temperature): None = off; k = the chosen token's plus the k most likely alternatives
    logprobs: int | None = None  # per generated token
    prompt_logprobs: int | None = None  # per prompt token (scoring; max_new_tokens may be 0)
    # logit processors (vLLM semantics): presence/frequency over the generated tokens,
    # repetition over prompt + generated (divides positive logits, multiplies negative)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)

    def __post_init__(self):
        try:  # the bounds SamplingConfig, the server's models and the CLI check too
            check_sampling(self.temperature, self.top_k, self.top_p)
        except SamplingError as e:
            raise RequestError(e.field, f"{e.bound}, got {e.value!r}") from None
        lo = 0 if self.prompt_logprobs is not None else 1
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= lo):
            raise RequestError("max_tokens", f"must be an integer >= {lo}, got "
                                             f"{self.max_new_tokens!r}")
        if not isinstance(self.seed, int):
            raise RequestError("seed", f"must be an integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and 0 <= v <= MAX_LOGPROBS):
                raise RequestError(name, f"must be None or an integer in [0, {MAX_LOGPROBS}], "
                                         f"got {v!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and -2.0 <= v <= 2.0):
                raise RequestError(name, f"must be a number in [-2, 2], got {v!r}")
        v = self.repetition_penalty
        if not (isinstance(v, (int, float)) and math.isfinite(v) and 0.0 < v <= 2.0):
            raise RequestError("repetition_penalty", f"must be a number in (0, 2], got {v!r}")
        for item in self.logit_bias:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int)
                    and isinstance(item[1], (int, float)) and math.isfinite(item[1])
                    and -100.0 <= item[1] <= 100.0):
                raise RequestError("logit_bias", f"must be (token id, bias in [-100, 100]) "
                                                 f"pairs, got {item!r}")

    @property
    def sampling(self) -> SamplingConfig:
        """The temperature / top-k / top-p part, as `research.decode.generate` takes it."""
        return SamplingConfig(self.temperature, self.top_k, self.top_p)

    @property
    def processed(self) -> bool:
        """Whether any logit processor (penalty, bias) changes this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias)


@dataclasses.dataclass(frozen=True, eq=False)  # arrays: events compare by identity here
class TopLogprobs:
    """Log-probabilities at n positions: the token's own and the K most likely.

    token_logprobs: [n] float32 (NaN where there is none: the first prompt token);
    top_ids / top_logprobs: [n, K] (K = MAX_LOGPROBS, most likely first)."""

    token_ids: tuple[int, ...]
    token_logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclasses.dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    arrival_time: float = 0.0  # time.perf_counter() when the server received it


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One new token of one request (or its end). `text` is the detokenized increment."""

    request_id: str
    token_id: int | None  # None on a pure finish event (e.g. abort)
    text: str
    finish_reason: FinishReason | None = None  # set on the request's last event
    n_prompt_tokens: int = 0
    n_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    # with SamplingParams.logprobs: the log-probability of `token_id` (or of
    # `stop_token_id`) and the MAX_LOGPROBS most likely (id, logprob) pairs
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    stop_token_id: int | None = None  # the stop token that ended the request (not in text)
    # with SamplingParams.prompt_logprobs: every prompt token's, on the request's first event
    prompt_logprobs: TopLogprobs | None = None
    error: str | None = None  # with finish_reason "error": what failed


@dataclasses.dataclass
class EngineMetrics:
    """Gauges/counters the server exports on /metrics."""

    queue_length: int = 0
    running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_hits: int = 0  # prompt tokens served from cache
    prefix_cache_queries: int = 0  # prompt tokens looked up
    preemptions: int = 0
    compiles: int = 0
    # cumulative step-time breakdown: whole `step()` calls, the forward calls in them
    # (device work + waiting for tokens), detokenization; the rest is host scheduling
    step_seconds: float = 0.0
    forward_seconds: float = 0.0
    detokenize_seconds: float = 0.0
