"""What the server's app and its routers share: the server's settings, its metrics and
the one `ServerState` every router reads. Below both server.py and routers.py (so neither
imports the other)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

from research.serving.engine_loop import EngineLoop
from research.serving.protocol import MAX_BODY_BYTES


@dataclasses.dataclass
class ServerConfig:
    model_name: str = "SmolLM2-135M-Instruct"
    max_context: int = 2048  # prompt + max_tokens must fit; the engine may refuse sooner
    default_max_tokens: int = 256  # chat requests without max_tokens
    disconnect_poll_s: float = 0.25  # non-streaming requests check for a gone client
    api_key: str | None = None  # when set, every endpoint but /health and /metrics
    #                             wants "Authorization: Bearer <api_key>" (else 401)
    max_body_bytes: int = MAX_BODY_BYTES  # larger request bodies get 413
    max_choices: int = 64  # prompts x n per request (at most the engine's max_queue)


class ServerMetrics(NamedTuple):
    """The app's Prometheus registry and the metrics the routers update."""

    registry: Any  # prometheus_client.CollectorRegistry
    ttft: Any  # Histogram: arrival to first token
    tpot: Any  # Histogram: time per output token, per request
    finished: Any  # Counter by finish_reason
    rejected: Any  # Counter by HTTP status


@dataclasses.dataclass
class ServerState:
    """What every router reads: the engine loop, tokenizer, config and metrics."""

    engine_loop: EngineLoop
    tokenizer: Any
    config: ServerConfig
    metrics: ServerMetrics
    stop_ids: tuple[int, ...]
    created: int

    @functools.cached_property
    def token_str(self):
        """Token id -> its text (for logprobs' `tokens`), memoised."""
        tok = self.tokenizer

        @functools.lru_cache(maxsize=1 << 16)
        def one(i: int) -> str:
            return tok.decode([i])

        return one
