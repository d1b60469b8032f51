"""The serving engine's host-side state: one live request (`LiveRequest`), a prefilled
request ready to insert (`Prefix`), the decode slots (`DecodeState`), the step counters
(`StepStats`) and the lifecycle states a request moves through:

    queued -> prefilling -> decoding -> finished | aborted, and prefilling / decoding ->
    preempted (blocks freed, tokens kept) -> prefilling again
"""
from __future__ import annotations

import dataclasses

import numpy as np

from research.serving.api import Request, SamplingParams
from research.serving.text_stream import TextStream

QUEUED, PREFILLING, DECODING, FINISHED, ABORTED, PREEMPTED = (
    "queued", "prefilling", "decoding", "finished", "aborted", "preempted")


class RequestFailed(Exception):
    """Building one request's row of a forward failed (the cause is chained): that request
    fails, not the engine."""

    def __init__(self, request_id: str):
        super().__init__(request_id)
        self.request_id = request_id


@dataclasses.dataclass
class LiveRequest:
    """One request the engine holds (queued, running or preempted) and its progress."""

    request: Request
    tokens: list[int]  # prompt + generated; KV computed for the first `computed`
    n_prompt: int
    text: TextStream
    stop_ids: frozenset
    state: str = QUEUED
    seq: int | None = None
    slot: int | None = None
    n_generated: int = 0
    n_cached: int = 0  # prompt tokens served from the prefix cache (first admission)
    admitted: int = -1  # admission order (preemption picks the latest)
    cached_blocks: int = 0  # full blocks already named in the prefix cache
    # prompt scoring (params.prompt_logprobs): per prompt position, filled as chunks run
    prompt_lp: np.ndarray | None = None  # [n_prompt] float32, NaN until scored
    prompt_top_ids: np.ndarray | None = None  # [n_prompt, MAX_LOGPROBS] int32
    prompt_top_lp: np.ndarray | None = None  # [n_prompt, MAX_LOGPROBS] float32
    prompt_lp_sent: bool = False

    @property
    def rid(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def scoring(self) -> bool:
        """Its prompt's log-probabilities are still to be computed and sent."""
        return self.prompt_lp is not None and not self.prompt_lp_sent

    @property
    def extended(self) -> bool:
        """Its rows need `serve_forward_ext` (logprobs or logit processors)."""
        return self.params.logprobs is not None or self.params.processed


@dataclasses.dataclass(frozen=True)
class Prefix:
    """A prefilled request, ready to `insert` (its first token is already generated)."""

    request_id: str
    n_computed: int  # tokens whose KV is in the pool
    n_cached: int  # of them, served from the prefix cache
    first_token: int | None  # None when the request ended at its first token
    finished: bool


@dataclasses.dataclass
class DecodeState:
    """Host view of the decode batch: the request id in each slot (None = free). The
    device state (model and KV pools) lives in the engine's `pool`."""

    slots: list
    steps: int = 0


@dataclasses.dataclass
class StepStats:
    """Scheduler counters: tokens computed per `step()` (decode + prefill chunks)."""

    steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    max_step_tokens: int = 0
    mixed_steps: int = 0  # steps that ran prefill chunks beside a decode batch
    # where a step's wall time goes (seconds, cumulative): the forward calls (device work
    # and the wait for their tokens), detokenization + stop strings, and the rest
    # (scheduling, block tables, sampling settings, events) = step_s - forward_s - detok_s
    read_slots: int = 0  # KV slots the forward passes attended over (rows x table width)
    step_s: float = 0.0
    forward_s: float = 0.0
    detokenize_s: float = 0.0

    @property
    def host_s(self) -> float:
        return self.step_s - self.forward_s - self.detokenize_s
