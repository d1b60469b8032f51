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
`abort` queues an "abort" finish event that the next `step()` returns.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


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

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0):
            raise RequestError("temperature", f"must be a number in [0, 100], got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise RequestError("top_k", f"must be an integer >= 0, got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise RequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise RequestError("max_tokens", f"must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.seed, int):
            raise RequestError("seed", f"must be an integer, got {self.seed!r}")


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
