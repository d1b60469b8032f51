"""Continuous-batching serving engine over the paged KV pool (JetStream / MaxEngine shape).

    engine = ServingEngine(model, tokenizer, n_blocks=512, block_size=16, max_batch=8,
                           max_len=1024, token_budget=256, max_queue=64)
    engine.add_request(Request("r1", tuple(tokenizer.encode("Hi")), SamplingParams()))
    while engine.has_work():
        for event in engine.step():          # TokenEvent: id, text increment, finish
            ...

The MaxEngine-shaped primitives are the same code the scheduler runs:
  prefill(request) -> Prefix       whole prompt (chunked, prefix-cache aware), first token
  insert(prefix, slot)             the request joins decode slot `slot`
  generate(state) -> (state, toks) one decode step for every live slot
`step()` = admit queued requests into free slots (while the free blocks, less those
the admitted prompts still need, hold the next whole prompt), one `generate` for the
decode slots, then chunks of prefill (`prefill_chunk` tokens per row) with what is left
of the step's `token_budget`; a request whose prefill completes is `insert`ed and decodes
next step.

Lifecycle: queued -> prefilling -> decoding -> finished (stop / length) or aborted; a
request is *preempted* (blocks freed, tokens kept, back to the queue front, recomputed
later: preemption by recompute) when the decode batch needs KV blocks the pool does not
have. Requests are never failed for lack of blocks; one request always fits the pool.

Tokens: each request's token at position p is drawn with a key derived from
(seed, p) only, so the same seed gives the same tokens whatever else is in the batch and
after a preemption. Greedy requests can decode speculatively (`speculative=k`):
prompt-lookup drafts of up to k tokens are verified in one forward; rejected ones are
rolled back by truncating the sequence's length and block table.

Shapes come from fixed buckets (decode [max_batch, 1], speculative [max_batch, k+1],
prefill [r, prefill_chunk] for r in powers of two up to `max_prefill_rows`, block tables
as wide as the pass's longest row rounded up to a power of two of blocks, at least
`min_read_len` tokens: a pass reads live blocks, not `max_len`), all compiled by
`warmup()`: no compiles while serving (`metrics().compiles` counts XLA backend compiles
since warm-up).

Prefix cache (`prefix_cache=True`, research/kv/prefix_cache.py): full blocks are named by
a chain hash of their token prefix; a new request adopts the longest cached run of its
prompt's blocks (reference counted; the last prompt token is always recomputed, copying a
shared partial block on write); unreferenced cached blocks are evicted LRU when the free
list runs short.

What the engine does not do yet:
- Sharding is tensor (and expert) parallel only (`mesh=`: params and the pool's KV heads
  split, research/sharding); rows are not split over a data axis, since any row may map
  any block of the one pool (run one engine per data-parallel replica).
- Speculative decoding only for greedy requests (sampled requests decode one token per
  step beside them) and only with prompt-lookup drafts; no draft model.
- The decode step and the prefill chunks are two forward calls per step (not one fused
  ragged batch), and each step waits for its tokens (no host/device overlap: on CPU the
  forward calls are ~99% of a step's wall time, `StepStats` / experiments/serving/overhead.py,
  so there is nothing to hide yet; on an accelerator there may be).
- No NaN/inf check while serving (`generate()` has one; here a non-finite row would
  sample garbage rather than fail).
- No priorities or fairness beyond first-come-first-served admission and
  latest-admitted-first preemption; no swapping to host memory (recompute only).
- No beam search; n > 1 is n requests (the server's job).

Scoring and logit processors (all off the fast path: a batch with none of them runs the
same `serve_forward` as before). A request with `prompt_logprobs` (its max_new_tokens may
be 0: a prefill, no decode) is scheduled, chunked and prefix-cached like any other; its
prefill chunks run `serve_forward_ext` with logits at every position and return each
prompt token's log-probability and top MAX_LOGPROBS alternatives. A cached block's K/V
holds no logits, so the engine keeps those per-token results of every full prompt block
it scored in a score cache named by the block's chain hash (what the prefix cache names
the block by): a scoring request adopts the longest run of leading blocks found in both
caches, less one token (the logits at its last adopted position must be recomputed for
the next token's score), so a shared few-shot prefix is computed once. Requests with
`logprobs`, penalties or `logit_bias` run their rows through `serve_forward_ext` too
(penalty counts and the bias as dense [R, V] arrays; speculative drafts are off in such
a step). Their programs compile on first use (counted by `metrics().compiles`), unless
`warmup_scoring=True`.
- Stop strings are matched on the detokenized text of the generated tokens only (not
  across the prompt boundary).

Failures of one request (defence in depth; the server validates first): `add_request`
builds a new request's per-row arrays (`sampling_rows`, `processor_rows`) once, so a
setting that does not fit them fails there, for that request only. An exception while
building a row inside `step()` names its request (`RequestFailed`): the forward is not
run, the rows' reserved KV lengths are rolled back (`_roll_back`), the request ends with
finish_reason "error" (its blocks freed) and the others go on next step; an exception
while accepting one request's new tokens ends that request the same way. Any other
exception in `step()` (the device, the shared forward) propagates: the engine's state is
then unknown.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from research.kv import paged
from research.kv.block_allocator import OutOfBlocksError
from research.model.llama import Model, forward
from research.kv.prefix_cache import chain_hashes
from research.serving.api import (MAX_LOGPROBS, EngineMetrics, QueueFullError, Request,
                                  RequestError, SamplingParams, TokenEvent, TopLogprobs)
from research.decode.paged_pool import PagedPool, pow2
from research.decode.sampling import process_logits, sample_per_row, sampling_bound

QUEUED, PREFILLING, DECODING, FINISHED, ABORTED, PREEMPTED = (
    "queued", "prefilling", "decoding", "finished", "aborted", "preempted")
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


class RequestFailed(Exception):
    """Building one request's row of a forward failed (the cause is chained): that request
    fails, not the engine."""

    def __init__(self, request_id: str):
        super().__init__(request_id)
        self.request_id = request_id


def sampling_rows(reqs, start, n_new):
    """Per-row sampling settings of a forward's rows (reqs[i] None = padding: greedy):
    temperature, top_k, top_p [R] and PRNG keys [R, 2] from (seed, position of the token
    to sample = start + n_new). RequestFailed names a row that cannot be built."""
    rows = len(reqs)
    temperature = np.zeros(rows, np.float32)
    top_k = np.zeros(rows, np.int32)
    top_p = np.ones(rows, np.float32)
    keys = np.zeros((rows, 2), np.uint32)
    for i, req in enumerate(reqs):
        if req is None:
            continue
        try:
            p = req.params
            temperature[i], top_k[i], top_p[i] = p.temperature, p.top_k, p.top_p
            if p.temperature > 0:
                keys[i] = token_key(p.seed, int(start[i]) + int(n_new[i]))
        except Exception as e:
            raise RequestFailed(req.rid) from e
    return temperature, top_k, top_p, keys


def processor_rows(reqs, start, n_new, vocab_size: int):
    """The logit processors' dense per-row arrays (`process_logits`' arguments): counts
    of generated tokens, seen tokens (prompt + generated), bias [R, V] and presence,
    frequency, repetition penalties [R], from the tokens known before each row's sampled
    one. RequestFailed names a row that cannot be built."""
    rows, v = len(reqs), vocab_size
    counts = np.zeros((rows, v), np.float32)
    seen = np.zeros((rows, v), bool)
    bias = np.zeros((rows, v), np.float32)
    pen = np.zeros((3, rows), np.float32)
    pen[2] = 1.0
    for i, req in enumerate(reqs):
        if req is None or not req.params.processed:
            continue
        try:
            p = req.params
            end = int(start[i]) + int(n_new[i])  # tokens known before the sampled one
            out = np.asarray(req.tokens[req.n_prompt:end], np.int64)
            counts[i] = np.bincount(out, minlength=v)[:v]
            seen[i, np.asarray(req.tokens[:end], np.int64)] = True
            for tok, b in p.logit_bias:
                bias[i, tok] += b
            pen[:, i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        except Exception as e:
            raise RequestFailed(req.rid) from e
    return counts, seen, bias, pen[0], pen[1], pen[2]


def token_key(seed: int, position: int) -> np.ndarray:
    """Key data (2 x uint32) for the token at `position` of a request seeded `seed`."""
    return np.random.SeedSequence([int(seed) % (1 << 64), int(position)]).generate_state(
        2, np.uint32)


def prompt_lookup_draft(tokens: Sequence[int], k: int, max_ngram: int = 3,
                        min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix
    n-gram (max_ngram..min_ngram) of `tokens` (host twin of specdecode's prompt_lookup)."""
    arr = np.asarray(tokens, np.int64)
    n = len(arr)
    if k < 1:
        return []
    for g in range(max_ngram, min_ngram - 1, -1):
        if g >= n:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(arr[:n - 1], g)
        hits = np.nonzero((windows == arr[n - g:]).all(axis=1))[0]
        if hits.size:
            cont = int(hits[-1]) + g
            return arr[cont:cont + k].tolist()
    return []


class TextStream:
    """Detokenized increments of a growing token list, with stop strings.

    Text is released only when it is final: never a trailing U+FFFD of an incomplete
    multi-byte character, never a tail that could still become a stop string.
    """

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.ids: list[int] = []
        self.n_emitted = 0  # characters released
        self._text = ""

    def push(self, token: int) -> tuple[str, bool]:
        """Add a token; returns (new final text, True if a stop string completed)."""
        self.ids.append(int(token))
        text = self._text = self.tokenizer.decode(self.ids, skip_special=True)
        hits = [i for i in (text.find(s, self.n_emitted) for s in self.stops) if i >= 0]
        if hits:
            return self._release(min(hits)), True
        safe = len(text.rstrip("\ufffd"))  # an incomplete multi-byte character waits
        hold = 0
        for s in self.stops:  # a tail that may still become a stop string waits
            for k in range(min(len(s) - 1, safe - self.n_emitted), hold, -1):
                if text[safe - k:safe] == s[:k]:
                    hold = k
                    break
        return self._release(safe - hold), False

    def flush(self) -> str:
        """Everything not yet released (the request ended without a stop string)."""
        return self._release(len(self._text))

    def released(self) -> str:
        """The text released so far."""
        return self._text[:self.n_emitted]

    def copy(self) -> TextStream:
        """An independent stream at the same point (the tokenizer is shared)."""
        out = TextStream(self.tokenizer, self.stops)
        out.ids, out.n_emitted, out._text = list(self.ids), self.n_emitted, self._text
        return out

    def _release(self, end: int) -> str:
        if end <= self.n_emitted:
            return ""
        out = self._text[self.n_emitted:end]
        self.n_emitted = end
        return out


@dataclasses.dataclass
class _Req:
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
class SpecStats:
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0


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


class ServingEngine:
    """Continuous batching over one `PagedPool` (see the module docstring).

    model: any servax Model with codec caches (f32/bf16/int8/TaSQ/..., any weight
      transform); its caches are paged into one pool of `n_blocks` x `block_size`.
    tokenizer: encode/decode(ids, skip_special=)/eos_id/token_to_id (stop ids default to
      EOS and <|im_end|> when the vocabulary has it).
    max_batch: decode slots; max_len: prompt + max_new_tokens per request.
    token_budget: tokens per step (decode tokens first, prefill chunks with the rest).
    prefill_chunk: tokens per prefill row per step (the prefill chunk shape).
    max_prefill_rows: prefill rows per step (default min(max_batch, budget // chunk)).
    max_queue: queued requests before add_request raises QueueFullError.
    speculative: prompt-lookup draft tokens per greedy decode step (0 = off).
    min_read_len: the smallest read bucket in tokens. Each pass attends over its rows'
      live blocks rounded up to a power of two (at least this many tokens), not over
      `max_len`; warm-up compiles every bucket (log2(max_len / min_read_len) + 1 of them).
    mesh / rules: serve from sharded state on a `jax.sharding.Mesh` (see `PagedPool`:
      tensor / expert parallel; `research.sharding.make_mesh(tensor=...)`).
    warmup_scoring: also compile the scoring / logprobs / logit-processor programs in
      `warmup()` (else on first use).
    """

    def __init__(self, model: Model, tokenizer, *, n_blocks: int = 256, block_size: int = 16,
                 max_batch: int = 8, max_len: int = 512, token_budget: int = 256,
                 prefill_chunk: int = 64, max_prefill_rows: int | None = None,
                 max_queue: int = 64, prefix_cache: bool = True, speculative: int = 0,
                 max_ngram: int = 3, stop_token_ids: Sequence[int] | None = None,
                 implementation: str = "auto", interpret: bool = False, warmup: bool = True,
                 mesh=None, rules=None, min_read_len: int = 128,
                 warmup_scoring: bool = False):
        for name, value in (("max_batch", max_batch), ("token_budget", token_budget),
                            ("prefill_chunk", prefill_chunk), ("max_queue", max_queue),
                            ("max_ngram", max_ngram), ("min_read_len", min_read_len)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not (isinstance(speculative, int) and speculative >= 0):
            raise ValueError(f"speculative must be an integer >= 0, got {speculative!r}")
        if token_budget < max_batch:
            raise ValueError(f"token_budget={token_budget} must cover one decode token per "
                             f"slot (max_batch={max_batch})")
        if n_blocks < -(-max_len // block_size) + 1:
            raise ValueError(f"n_blocks={n_blocks} cannot hold one request of max_len="
                             f"{max_len} plus one copy-on-write block: need at least "
                             f"{-(-max_len // block_size) + 1} blocks of {block_size}")
        self.pool = PagedPool(model, n_blocks=n_blocks, block_size=block_size,
                              max_len=max_len, implementation=implementation,
                              interpret=interpret, prefix_cache=prefix_cache, mesh=mesh,
                              rules=rules)
        # a model holding one weight set per phase (research.dynacore) prefills with its
        # prefill set and decodes with its decode set; other models serve both as they are
        self._phase_models = {phase: self.pool.model.for_phase(phase)
                              for phase in ("prefill", "decode")}
        self._min_table_blocks = -(-min_read_len // block_size)
        self.tokenizer = tokenizer
        self.vocab_size = model.config.vocab_size
        self.max_batch, self.max_len = max_batch, max_len
        self.token_budget, self.prefill_chunk = token_budget, prefill_chunk
        self.max_prefill_rows = max_prefill_rows or max(1, min(max_batch,
                                                               token_budget // prefill_chunk))
        if not 1 <= self.max_prefill_rows <= max_batch:
            raise ValueError(f"max_prefill_rows must be in [1, {max_batch}], got "
                             f"{max_prefill_rows}")
        self.max_queue, self.speculative, self.max_ngram = max_queue, speculative, max_ngram
        if stop_token_ids is None:
            ids = {getattr(tokenizer, "eos_id", None), tokenizer.token_to_id("<|im_end|>")}
            stop_token_ids = sorted(i for i in ids if i is not None)
        self.stop_token_ids = tuple(int(i) for i in stop_token_ids)
        self.state = DecodeState([None] * max_batch)
        self.spec_stats = SpecStats()
        self.step_stats = StepStats()
        self._last_decode_tokens = 0
        self._queue: collections.deque[_Req] = collections.deque()
        self._live: dict[str, _Req] = {}  # every request holding blocks or a slot
        self._events: list[TokenEvent] = []
        self._admissions = 0
        self._preemptions = 0
        self._compiles0 = compile_count()
        self.warmup_scoring = warmup_scoring
        # block chain hash -> (token logprobs [bs], top ids [bs, K], top logprobs [bs, K])
        self._score_cache: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self._score_cache_size = n_blocks
        if warmup:
            self.warmup()

    # -- driver (vLLM-style loop) -----------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; RequestError (field named) if it cannot be served,
        QueueFullError when `max_queue` requests already wait."""
        req = self._validated(request)
        if len(self._queue) >= self.max_queue:
            raise QueueFullError(f"{len(self._queue)} requests already queued "
                                 f"(max_queue={self.max_queue})")
        self._queue.append(req)

    def abort(self, request_id: str) -> None:
        """End a queued or running request (its blocks freed); unknown ids are ignored."""
        for req in self._queue:
            if req.rid == request_id:
                self._queue.remove(req)
                self._end(req, ABORTED, None, "", "abort")
                return
        req = self._live.get(request_id)
        if req is not None:
            self._end(req, ABORTED, None, "", "abort")

    def has_work(self) -> bool:
        return bool(self._queue or self._live or self._events)

    def unshare(self, request_id: str) -> int:
        """Give a live request private copies of every KV block it holds (prefix-cache
        hits included); returns how many blocks were copied. For measurements that must
        not let rows read the same pages (shared pages stay hot in a CPU's caches), e.g.
        many rows built from one prefilled prompt. OutOfBlocksError (nothing changed)
        when the pool has too few free blocks."""
        req = self._live.get(request_id)
        if req is None or req.seq is None:
            raise ValueError(f"request {request_id!r} is not a live request holding KV")
        seq, n = self._private_copy(req.seq)
        self.pool.manager.free(req.seq)
        req.seq = seq
        return n

    def _private_copy(self, seq: int) -> tuple[int, int]:
        """A new sequence holding private copies of `seq`'s blocks, copied on the device;
        returns (its id, blocks copied). OutOfBlocksError (nothing changed) if too few
        blocks are free."""
        new, copies = self.pool.manager.fork_copy(seq)
        self.pool.copy(copies)
        return new, len(copies)

    def fork(self, request_id: str, new_request_id: str) -> Prefix:
        """A new request `new_request_id` that stands exactly where the live, prefilled
        request `request_id` stands: the same prompt, settings and generated tokens, and
        private copies of its KV blocks, with no forward (re-prefilling the prompt gives
        the same state: sampling keys come from (seed, position)). Its text so far
        arrives as one event; `insert` it into a slot to decode it. The cheap way to
        many rows of one long prompt (a re-prefill through the prefix cache recomputes
        the last block through the codec's read). RequestError if the id is taken;
        ValueError if the source is not live and prefilled; OutOfBlocksError (nothing
        changed) when the pool has too few free blocks."""
        src = self._live.get(request_id)
        if (src is None or src.seq is None or src.state not in (PREFILLING, DECODING)
                or self.pool.manager.length(src.seq) != len(src.tokens) - 1):
            raise ValueError(f"request {request_id!r} is not a live prefilled request")
        req = self._validated(dataclasses.replace(src.request, request_id=new_request_id))
        req.seq, _ = self._private_copy(src.seq)
        req.tokens = list(src.tokens)
        req.n_generated, req.n_cached, req.cached_blocks = (src.n_generated, src.n_cached,
                                                            src.cached_blocks)
        req.text = src.text.copy()
        req.prompt_lp, req.prompt_top_ids, req.prompt_top_lp, req.prompt_lp_sent = (
            src.prompt_lp, src.prompt_top_ids, src.prompt_top_lp, src.prompt_lp_sent)
        req.state, req.admitted = PREFILLING, self._admissions
        self._admissions += 1
        self._live[req.rid] = req
        self._emit(req, req.tokens[-1], req.text.released(), None)
        return self._prefix(req)

    def step(self) -> list[TokenEvent]:
        """One scheduler iteration: admit, one decode step, prefill chunks. A request whose
        row cannot be built fails alone (finish_reason "error"; see the module docstring)."""
        t0 = time.perf_counter()
        used = prefilled = 0
        try:
            self._admit()
            if any(self._slot_req(s) is not None and self._slot_req(s).state == DECODING
                   for s in range(self.max_batch)):
                used = self._decode(self.token_budget)
            prefilled = self._prefill_chunks(self.token_budget - used)
        except RequestFailed as e:  # the forward did not run; its rows were rolled back
            self._fail(e.request_id, e.__cause__)
        st = self.step_stats
        st.steps += 1
        st.decode_tokens += used
        st.prefill_tokens += prefilled
        st.max_step_tokens = max(st.max_step_tokens, used + prefilled)
        st.mixed_steps += bool(used and prefilled)
        st.step_s += time.perf_counter() - t0
        events, self._events = self._events, []
        return events

    def metrics(self) -> EngineMetrics:
        pc = self.pool.prefix_cache
        return EngineMetrics(
            queue_length=len(self._queue),
            running=sum(r.state in (PREFILLING, DECODING) for r in self._live.values()),
            kv_blocks_used=self.pool.blocks_in_use(), kv_blocks_total=self.pool.n_blocks,
            prefix_cache_hits=pc.hits if pc else 0, prefix_cache_queries=pc.queries if pc else 0,
            preemptions=self._preemptions, compiles=compile_count() - self._compiles0,
            step_seconds=self.step_stats.step_s, forward_seconds=self.step_stats.forward_s,
            detokenize_seconds=self.step_stats.detokenize_s)

    # -- MaxEngine-shaped primitives --------------------------------------------------
    def prefill(self, request: Request) -> Prefix:
        """Validate `request`, compute its whole prompt's KV (prefix-cache aware, in
        `prefill_chunk` pieces) and generate its first token. Its events go to the next
        `step()` / `drain_events()`."""
        req = self._validated(request)
        self._start(req, slot=None)
        while True:
            pending = len(req.tokens) - self.pool.manager.length(req.seq)
            n = min(self.prefill_chunk, pending)
            try:
                self.pool.reserve({req.seq: n})
            except OutOfBlocksError:
                victims = [r for r in self._live.values() if r is not req and r.seq is not None]
                if not victims:
                    raise
                self._preempt(max(victims, key=lambda r: r.admitted))
                continue
            self._forward_prefill([(req, n)])
            if n == pending:  # the last chunk: the first token is generated
                return self._prefix(req)

    def insert(self, prefix: Prefix, slot: int) -> None:
        """Put a prefilled request into decode slot `slot` (free, or already its own)."""
        req = self._live.get(prefix.request_id)
        if req is None or req.state not in (PREFILLING, DECODING) or prefix.finished:
            raise ValueError(f"request {prefix.request_id!r} is not a live prefilled request")
        if not 0 <= slot < self.max_batch:
            raise ValueError(f"slot must be in [0, {self.max_batch}), got {slot}")
        if self.state.slots[slot] not in (None, req.rid):
            raise ValueError(f"slot {slot} holds request {self.state.slots[slot]!r}")
        if self.pool.manager.length(req.seq) != len(req.tokens) - 1:
            raise ValueError(f"request {req.rid!r} is not fully prefilled")
        if req.slot is not None and req.slot != slot:
            self.state.slots[req.slot] = None
        self.state.slots[slot] = req.rid
        req.slot, req.state = slot, DECODING

    def generate(self, state: DecodeState) -> tuple[DecodeState, list[list[int]]]:
        """One decode step of every request in a slot: new tokens per slot ([] = idle or
        preempted), stop and length handled (events queued)."""
        if state is not self.state:
            raise ValueError("generate takes the engine's own DecodeState (engine.state)")
        toks = self._decode_tokens(self.token_budget)
        return self.state, toks

    def drain_events(self) -> list[TokenEvent]:
        """Events produced outside `step()` (by direct prefill/insert/generate calls)."""
        events, self._events = self._events, []
        return events

    # -- warm-up ----------------------------------------------------------------------
    def decode_shapes(self) -> list[tuple[int, int]]:
        shapes = [(self.max_batch, 1)]
        if self.speculative:
            shapes.append((self.max_batch, self.speculative + 1))
        return shapes

    def prefill_shapes(self) -> list[tuple[int, int]]:
        rows, r = [], 1
        while r < self.max_prefill_rows:
            rows.append(r)
            r *= 2
        rows.append(self.max_prefill_rows)
        return [(r, self.prefill_chunk) for r in rows]

    def table_widths(self) -> list[int]:
        """Block-table widths a pass may use: each pass reads a power-of-two bucket of its
        rows' live blocks (at least `min_read_len` tokens), not the whole `max_len`."""
        return self.pool.table_widths(self._min_table_blocks)

    def _table_width(self, n_blocks: int) -> int:
        return self.pool.table_width(n_blocks, self._min_table_blocks)

    def warmup(self) -> None:
        """Compile every shape `step()` can use (all-padding batches write nothing)."""
        shapes = ([(r, t, False, "prefill") for r, t in self.prefill_shapes()]
                  + [(r, t, t > 1, "decode") for r, t in self.decode_shapes()])
        for rows, t, verify, phase in shapes:
            for width in self.table_widths():
                self._run_forward(np.zeros((rows, t), np.int32), np.zeros(rows, np.int32),
                                  np.zeros(rows, np.int32),
                                  np.full((rows, width), -1, np.int32),
                                  [None] * rows, verify=verify, phase=phase)
                if not self.warmup_scoring or verify:
                    continue
                combos = [(sc, pr) for sc in (False, True) for pr in (False, True)
                          if phase == "prefill" or not sc]
                for score, process in combos:
                    self._run_forward_ext(
                        np.zeros((rows, t), np.int32), np.zeros(rows, np.int32),
                        np.zeros(rows, np.int32), np.full((rows, width), -1, np.int32),
                        [None] * rows, phase=phase, score=score, process=process)
        self.pool.warm_copies(pow2(self.max_batch, minimum=8))
        self.step_stats = StepStats()  # warm-up's calls are not serving time
        self._compiles0 = compile_count()

    # -- scheduling -------------------------------------------------------------------
    def _admit(self) -> None:
        """Queued requests take free slots while the pool has room for their tokens: the
        free blocks, less those the already admitted prompts still need, must hold the
        whole prompt. (Counting only today's free blocks admitted every request of a
        burst at once, and the burst then thrashed by preemption.)"""
        promised = self._blocks_promised()
        while self._queue:
            free = [s for s in range(self.max_batch) if self.state.slots[s] is None]
            if not free:
                return
            req = self._queue[0]
            need = -(-(len(req.tokens) + 1) // self.pool.block_size)
            if self._live and self.pool.n_available() - promised < need:
                return
            self._queue.popleft()
            self._start(req, slot=free[0])
            promised += self._prompt_blocks_pending(req)

    def _prompt_blocks_pending(self, req: _Req) -> int:
        """Fresh blocks `req` still needs to hold its whole prompt and first token."""
        todo = len(req.tokens) + 1 - self.pool.manager.length(req.seq)
        return self.pool.manager.fresh_blocks_needed({req.seq: todo}) if todo > 0 else 0

    def _blocks_promised(self) -> int:
        return sum(self._prompt_blocks_pending(r) for r in self._live.values()
                   if r.state == PREFILLING and r.seq is not None)

    def _start(self, req: _Req, slot: int | None) -> None:
        """Queued/preempted -> prefilling: adopt the cached prefix, reserve the slot."""
        m = self.pool.manager
        first = req.state == QUEUED
        blocks = self.pool.prefix_cache.match(req.tokens) if self.pool.prefix_cache else []
        if req.scoring:
            blocks = self._adopt_scores(req, blocks)
        n_cached = min(len(blocks) * self.pool.block_size, len(req.tokens) - 1)
        if req.scoring and n_cached:  # the logits at the last adopted position are needed
            n_cached -= 1
        blocks = blocks[:-(-n_cached // self.pool.block_size)] if n_cached else []
        req.seq = m.adopt(blocks, n_cached) if blocks else m.new_sequence()
        req.cached_blocks = n_cached // self.pool.block_size
        if first:
            req.n_cached = min(n_cached, req.n_prompt)
        req.state, req.slot, req.admitted = PREFILLING, slot, self._admissions
        self._admissions += 1
        if slot is not None:
            self.state.slots[slot] = req.rid
        self._live[req.rid] = req

    def _adopt_scores(self, req: _Req, blocks: list[int]) -> list[int]:
        """The leading `blocks` whose per-token scores are in the score cache (copied into
        `req`): a scoring request adopts only K/V whose logits it need not see."""
        bs = self.pool.block_size
        hashes = chain_hashes(req.tokens[:len(blocks) * bs], bs)
        k = 0
        while k < len(hashes) and hashes[k] in self._score_cache:
            lp, ids, tops = self._score_cache[hashes[k]]
            self._score_cache.move_to_end(hashes[k])
            sl = slice(k * bs, (k + 1) * bs)
            req.prompt_lp[sl], req.prompt_top_ids[sl], req.prompt_top_lp[sl] = lp, ids, tops
            k += 1
        return blocks[:k]

    def _store_scores(self, req: _Req) -> None:
        """Put the per-token scores of `req`'s full prompt blocks into the score cache."""
        bs = self.pool.block_size
        for k, h in enumerate(chain_hashes(req.tokens[:req.n_prompt], bs)):
            sl = slice(k * bs, (k + 1) * bs)
            if h not in self._score_cache:
                self._score_cache[h] = (req.prompt_lp[sl].copy(), req.prompt_top_ids[sl].copy(),
                                        req.prompt_top_lp[sl].copy())
            self._score_cache.move_to_end(h)
        while len(self._score_cache) > self._score_cache_size:
            self._score_cache.popitem(last=False)

    def _prefill_chunks(self, budget: int) -> int:
        """Prefill chunks for prefilling requests (admission order) within `budget`;
        returns the tokens computed."""
        rows = []
        for req in sorted((r for r in self._live.values() if r.state == PREFILLING
                           and r.slot is not None), key=lambda r: r.admitted):
            if budget <= 0 or len(rows) == self.max_prefill_rows:
                break
            if req.state != PREFILLING:  # preempted earlier in this loop
                continue
            n = min(self.prefill_chunk, budget,
                    len(req.tokens) - self.pool.manager.length(req.seq))
            try:
                self.pool.reserve({req.seq: n})
            except OutOfBlocksError:
                n = self._partial_room(req, n)
                if n == 0:
                    if not rows and not self._any_decoding():
                        self._preempt_other(req)  # nothing else can make progress
                    continue
                self.pool.reserve({req.seq: n})
            rows.append((req, n))
            budget -= n
        if rows:
            self._forward_prefill(rows)
        return sum(n for _, n in rows)

    def _partial_room(self, req: _Req, n: int) -> int:
        """The most tokens of `n` the free list (after eviction) can take now."""
        room = self.pool.n_available()
        best = 0
        for k in range(1, n + 1):
            if self.pool.manager.fresh_blocks_needed({req.seq: k}) > room:
                break
            best = k
        return best

    def _any_decoding(self) -> bool:
        return any(r.state == DECODING for r in self._live.values())

    def _preempt_other(self, req: _Req) -> None:
        victims = [r for r in self._live.values() if r is not req and r.seq is not None]
        if victims:
            self._preempt(max(victims, key=lambda r: r.admitted))

    def _preempt(self, req: _Req) -> None:
        """Preemption by recompute: blocks freed (full ones stay in the prefix cache),
        tokens kept, back to the front of the queue."""
        self._release(req)
        req.state = PREEMPTED
        self._queue.appendleft(req)
        self._preemptions += 1

    def _release(self, req: _Req) -> None:
        if req.seq is not None:
            self.pool.cache_blocks(req.seq, req.tokens)
            self.pool.manager.free(req.seq)
            req.seq = None
        if req.slot is not None and self.state.slots[req.slot] == req.rid:
            self.state.slots[req.slot] = None
        req.slot = None
        self._live.pop(req.rid, None)

    def _roll_back(self, reqs, start) -> None:
        """Undo a forward's reservations before it runs: row i's sequence back to its
        length `start[i]` (its KV computed up to there; the blocks reserved past it freed)."""
        for i, req in enumerate(reqs):
            if req is not None and req.seq is not None:
                self.pool.manager.truncate(req.seq, min(int(start[i]),
                                                        self.pool.manager.length(req.seq)))

    def _fail(self, request_id: str, error: BaseException | None) -> None:
        """End a live request with finish_reason "error" (its blocks freed)."""
        req = self._live.get(request_id)
        if req is None:
            return
        self._release(req)
        req.state = ABORTED
        self._events.append(TokenEvent(req.rid, None, "", "error", req.n_prompt,
                                       req.n_cached, error=repr(error)[:500]))

    def _end(self, req: _Req, state: str, token: int | None, text: str, reason: str,
             lp=None, stop_token: int | None = None) -> None:
        self._release(req)
        req.state = state
        self._emit(req, token, text, reason, lp, stop_token)

    def _emit(self, req: _Req, token: int | None, text: str, reason: str | None, lp=None,
              stop_token: int | None = None) -> None:
        """Queue an event; lp = (logprob, top (id, logprob) pairs) of token / stop_token
        when the request asked for logprobs; the prompt's scores ride on its first."""
        prompt = None
        if req.scoring and reason != "abort":
            prompt = TopLogprobs(tuple(req.tokens[:req.n_prompt]), req.prompt_lp,
                                 req.prompt_top_ids, req.prompt_top_lp)
            req.prompt_lp_sent = True
        logprob = top = None
        if lp is not None and req.params.logprobs is not None:
            logprob, top = lp
        self._events.append(TokenEvent(req.rid, token, text, reason, req.n_prompt,
                                       req.n_cached, logprob, top, stop_token, prompt))

    # -- decode -----------------------------------------------------------------------
    def _decode(self, budget: int) -> int:
        """Decode step inside `step()`; returns the tokens it computed."""
        self._decode_tokens(budget)
        return self._last_decode_tokens

    def _decode_tokens(self, budget: int) -> list[list[int]]:
        live = [self._slot_req(s) for s in range(self.max_batch)]
        live = [r for r in live if r is not None and r.state == DECODING]
        out: list[list[int]] = [[] for _ in range(self.max_batch)]
        self._last_decode_tokens = 0
        if not live:
            return out
        extended = any(r.extended for r in live)
        drafts = {r.rid: [] if extended else self._draft(r) for r in live}
        spare = budget - len(live) - self._prefill_demand()  # drafts never starve prefill
        for r in live:  # drafts only within the step's token budget
            drafts[r.rid] = drafts[r.rid][:max(0, spare)]
            spare -= len(drafts[r.rid])
        while True:
            try:
                self.pool.reserve({r.seq: 1 + len(drafts[r.rid]) for r in live})
                break
            except OutOfBlocksError:
                if any(drafts.values()):
                    drafts = {k: [] for k in drafts}
                    continue
                victim = max((r for r in self._live.values() if r.seq is not None),
                             key=lambda r: r.admitted)
                self._preempt(victim)
                live = [r for r in live if r is not victim]
                if not live:
                    return out
        self._last_decode_tokens = sum(1 + len(drafts[r.rid]) for r in live)
        t = self.speculative + 1 if any(drafts.values()) else 1
        b, m = self.max_batch, self.pool.manager
        tokens = np.zeros((b, t), np.int32)
        start = np.zeros(b, np.int32)
        n_new = np.zeros(b, np.int32)
        for r in live:
            d = drafts[r.rid]
            tokens[r.slot, :1 + len(d)] = [r.tokens[-1]] + d
            start[r.slot] = m.length(r.seq) - 1 - len(d)  # reserve advanced the length
            n_new[r.slot] = 1 + len(d)
        rows = [None] * b
        for r in live:
            rows[r.slot] = r
        table = self.pool.block_table([], b, self._table_width(
            max(len(m.blocks(r.seq)) for r in live)))
        for r in live:
            blocks = m.blocks(r.seq)
            table[r.slot, :len(blocks)] = blocks
        if extended:
            sampled, greedy, lps = self._run_forward_ext(tokens, start, n_new, table, rows,
                                                         phase="decode", score=False)
        else:
            sampled, greedy = self._run_forward(tokens, start, n_new, table, rows,
                                                verify=t > 1, phase="decode")
        for r in live:
            d = drafts[r.rid]
            if d:
                g = greedy[r.slot]
                a = 0
                while a < len(d) and d[a] == int(g[a]):
                    a += 1
                new = d[:a] + [int(g[a])]
                m.truncate(r.seq, int(start[r.slot]) + a + 1)
                self.spec_stats.drafted += len(d)
                self.spec_stats.accepted += a
                self.spec_stats.verify_steps += 1
            else:
                new = [int(sampled[r.slot])]
            out[r.slot] = new
            try:
                self._accept(r, new, [lps[r.slot]] if extended else None)
            except Exception as e:  # noqa: BLE001 - this request fails, not the engine
                self._fail(r.rid, e)
        self.state.steps += 1
        return out

    def _prefill_demand(self) -> int:
        """Tokens the next prefill chunks want (what drafts must leave of the budget)."""
        pending = sorted((r for r in self._live.values() if r.state == PREFILLING
                          and r.slot is not None and r.seq is not None),
                         key=lambda r: r.admitted)[:self.max_prefill_rows]
        return sum(min(self.prefill_chunk, len(r.tokens) - self.pool.manager.length(r.seq))
                   for r in pending)

    def _draft(self, req: _Req) -> list[int]:
        if not self.speculative or req.params.temperature != 0 or req.extended:
            return []
        room = req.params.max_new_tokens - req.n_generated - 1
        k = min(self.speculative, room, self.max_len - len(req.tokens))
        return prompt_lookup_draft(req.tokens, k, self.max_ngram) if k > 0 else []

    # -- prefill ----------------------------------------------------------------------
    def _forward_prefill(self, rows: list[tuple[_Req, int]]) -> None:
        """One prefill forward over (request, n tokens) rows (blocks already reserved)."""
        r = min(pow2(len(rows)), self.max_prefill_rows)
        m = self.pool.manager
        tokens = np.zeros((r, self.prefill_chunk), np.int32)
        start = np.zeros(r, np.int32)
        n_new = np.zeros(r, np.int32)
        for i, (req, n) in enumerate(rows):
            p = m.length(req.seq) - n  # reserve advanced the length
            tokens[i, :n] = req.tokens[p:p + n]
            start[i], n_new[i] = p, n
        table = self.pool.block_table([req.seq for req, _ in rows], r, self._table_width(
            max(len(m.blocks(req.seq)) for req, _ in rows)))
        reqs = [req for req, _ in rows] + [None] * (r - len(rows))
        score = any(req.scoring for req, _ in rows)
        lps = None
        if score or any(req.extended for req, _ in rows):
            sampled, _, lps = self._run_forward_ext(tokens, start, n_new, table, reqs,
                                                    phase="prefill", score=score)
        else:
            sampled, _ = self._run_forward(tokens, start, n_new, table, reqs, verify=False,
                                           phase="prefill")
        for i, (req, n) in enumerate(rows):
            try:
                self._after_prefill(req, int(sampled[i]), lps[i] if lps is not None else None)
            except Exception as e:  # noqa: BLE001 - this request fails, not the engine
                self._fail(req.rid, e)

    def _after_prefill(self, req: _Req, sampled: int, lp) -> None:
        """A prefill row's results: the first token once the whole prompt is computed."""
        if self.pool.manager.length(req.seq) == len(req.tokens):  # the whole context
            if req.scoring:
                self._store_scores(req)
            if req.params.max_new_tokens == 0:  # scoring only: a prefill, no decode
                self._end(req, FINISHED, None, "", "length")
                return
            self._accept(req, [sampled], [lp] if lp is not None else None)
            if req.state == PREFILLING and req.slot is not None:
                self.insert(self._prefix(req), req.slot)
        else:
            self._cache_new_blocks(req)

    def _prefix(self, req: _Req) -> Prefix:
        done = req.state in (FINISHED, ABORTED)
        return Prefix(req.rid, len(req.tokens) - 1, req.n_cached,
                      None if done else req.tokens[-1], done)

    # -- the forward call -------------------------------------------------------------
    def _run_forward(self, tokens, start, n_new, table, reqs, *, verify: bool, phase: str):
        """Forward + per-row sampling; returns (sampled [R], greedy [R, T]) on the host.
        phase: "prefill" or "decode", the model view that runs (Model.for_phase).
        reqs[i]: the request of row i (None = padding); its next token's position is
        start + n_new (keys from (seed, position))."""
        try:
            temperature, top_k, top_p, keys = sampling_rows(reqs, start, n_new)
        except RequestFailed:
            self._roll_back(reqs, start)
            raise
        self.step_stats.read_slots += table.size * self.pool.block_size
        t0 = time.perf_counter()
        self.pool.pools, sampled, greedy = serve_forward(
            self._phase_models[phase], self.pool.pools, table, tokens, start, n_new,
            temperature, top_k, top_p, keys, verify=verify)
        sampled, greedy = np.asarray(sampled), np.asarray(greedy)
        self.step_stats.forward_s += time.perf_counter() - t0
        return sampled, greedy

    def _run_forward_ext(self, tokens, start, n_new, table, reqs, *, phase: str,
                         score: bool, process: bool | None = None):
        """`_run_forward` for batches with scoring / logprobs / logit processors: returns
        (sampled [R], greedy [R, 1], per row (logprob, top pairs) of its sampled token);
        with `score`, the scoring rows' prompt positions are filled in as a side effect."""
        rows, t = tokens.shape
        if process is None:
            process = any(r is not None and r.params.processed for r in reqs)
        try:
            temperature, top_k, top_p, keys = sampling_rows(reqs, start, n_new)
            targets = np.zeros((rows, t), np.int32)
            for i, req in enumerate(reqs):
                if score and req is not None and req.scoring:  # row i, column j predicts
                    lo = int(start[i]) + 1                      # prompt token start + j + 1
                    hi = min(int(start[i]) + int(n_new[i]) + 1, req.n_prompt)
                    targets[i, :max(0, hi - lo)] = req.tokens[lo:hi]
            proc = processor_rows(reqs, start, n_new, self.vocab_size) if process else None
        except RequestFailed:
            self._roll_back(reqs, start)
            raise
        self.step_stats.read_slots += table.size * self.pool.block_size
        t0 = time.perf_counter()
        self.pool.pools, out = serve_forward_ext(
            self._phase_models[phase], self.pool.pools, table, tokens, start, n_new,
            temperature, top_k, top_p, keys, targets, proc, score=score)
        out = jax.device_get(out)
        self.step_stats.forward_s += time.perf_counter() - t0
        sampled, greedy, lp, top_ids, top_lp = (np.asarray(x) for x in out[:5])
        if score:
            tgt_lp, pos_ids, pos_lp = out[5:]
            for i, req in enumerate(reqs):
                if req is None or not req.scoring:
                    continue
                lo, hi = int(start[i]) + 1, min(int(start[i]) + int(n_new[i]) + 1, req.n_prompt)
                if hi > lo:
                    req.prompt_lp[lo:hi] = tgt_lp[i, :hi - lo]
                    req.prompt_top_ids[lo:hi] = pos_ids[i, :hi - lo]
                    req.prompt_top_lp[lo:hi] = pos_lp[i, :hi - lo]
        lps = [(float(lp[i]), tuple(zip(top_ids[i].tolist(), top_lp[i].tolist())))
               for i in range(rows)]
        return sampled, greedy, lps

    # -- tokens -> events -------------------------------------------------------------
    def _accept(self, req: _Req, new: list[int], lps: list | None = None) -> None:
        """New tokens of `req` in order: stop ids, stop strings, max tokens -> events.
        lps: per new token, (its logprob, top (id, logprob) pairs), or None."""
        for j, tok in enumerate(new):
            lp = lps[j] if lps is not None else None
            if tok in req.stop_ids:
                self._end(req, FINISHED, None, req.text.flush(), "stop", lp, stop_token=tok)
                return
            req.tokens.append(tok)
            req.n_generated += 1
            t0 = time.perf_counter()
            text, stopped = req.text.push(tok)
            self.step_stats.detokenize_s += time.perf_counter() - t0
            if stopped:
                self._end(req, FINISHED, tok, text, "stop", lp)
                return
            if req.n_generated >= req.params.max_new_tokens:
                self._end(req, FINISHED, tok, text + req.text.flush(), "length", lp)
                return
            self._emit(req, tok, text, None, lp)
        self._cache_new_blocks(req)

    def _cache_new_blocks(self, req: _Req) -> None:
        """Name newly completed full blocks in the prefix cache as they fill."""
        if self.pool.prefix_cache is None or req.seq is None:
            return
        full = self.pool.manager.length(req.seq) // self.pool.block_size
        if full > req.cached_blocks:
            self.pool.cache_blocks(req.seq, req.tokens)
            req.cached_blocks = full

    def _slot_req(self, slot: int) -> _Req | None:
        rid = self.state.slots[slot]
        return None if rid is None else self._live.get(rid)

    # -- validation -------------------------------------------------------------------
    def _validated(self, request: Request) -> _Req:
        if not isinstance(request, Request):
            raise RequestError("request", f"expected a Request, got {type(request).__name__}")
        rid = request.request_id
        if not isinstance(rid, str) or not rid:
            raise RequestError("request_id", f"must be a non-empty string, got {rid!r}")
        if rid in self._live or any(r.rid == rid for r in self._queue):
            raise RequestError("request_id", f"{rid!r} is already queued or running")
        if not isinstance(request.params, SamplingParams):
            raise RequestError("params", f"expected SamplingParams, got "
                                         f"{type(request.params).__name__}")
        ids = request.prompt_ids
        if not ids:
            raise RequestError("prompt", "is empty: at least one token is needed")
        if not all(isinstance(t, (int, np.integer)) and 0 <= t < self.vocab_size for t in ids):
            raise RequestError("prompt", f"token ids must be integers in [0, {self.vocab_size})")
        p = request.params
        if len(ids) >= self.max_len:
            raise RequestError("prompt", f"{len(ids)} tokens; the engine serves at most "
                                         f"max_len - 1 = {self.max_len - 1} prompt tokens")
        if len(ids) + p.max_new_tokens > self.max_len:
            raise RequestError("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens "
                                             f"({p.max_new_tokens}) exceeds max_len="
                                             f"{self.max_len}")
        if not all(isinstance(s, str) and s for s in p.stop):
            raise RequestError("stop", f"stop strings must be non-empty strings, got {p.stop!r}")
        if not all(isinstance(t, (int, np.integer)) and 0 <= t < self.vocab_size
                   for t in p.stop_token_ids):
            raise RequestError("stop_token_ids", f"must be integers in [0, {self.vocab_size})")
        if not all(0 <= t < self.vocab_size for t, _ in p.logit_bias):
            raise RequestError("logit_bias", f"token ids must be integers in [0, "
                                             f"{self.vocab_size})")
        bound = sampling_bound("top_k", p.top_k, vocab_size=self.vocab_size)
        if bound is not None:
            raise RequestError("top_k", f"{bound}, got {p.top_k}")
        tokens = [int(t) for t in ids]
        req = _Req(request, tokens, len(tokens), TextStream(self.tokenizer, p.stop),
                   frozenset(self.stop_token_ids + tuple(int(t) for t in p.stop_token_ids)))
        if p.prompt_logprobs is not None:
            n = len(tokens)
            req.prompt_lp = np.full(n, np.nan, np.float32)
            req.prompt_top_ids = np.zeros((n, MAX_LOGPROBS), np.int32)
            req.prompt_top_lp = np.full((n, MAX_LOGPROBS), np.nan, np.float32)
        self._build_rows(req)
        return req

    def _build_rows(self, req: _Req) -> None:
        """Build `req`'s rows of a forward once, alone, so that a setting which does not
        fit the per-row arrays fails its request here rather than a shared step later."""
        zero = np.zeros(1, np.int32)
        try:
            sampling_rows([req], zero, zero)
            if req.params.processed:
                processor_rows([req], zero, zero, self.vocab_size)
        except RequestFailed as e:
            raise e.__cause__ from None


@functools.partial(jax.jit, static_argnames=("verify",), donate_argnums=(1,))
def serve_forward(model: Model, pools: tuple, table, tokens, start, n_new, temperature,
                   top_k, top_p, key_data, *, verify: bool):
    """Rows' pending tokens through the paged caches; the token after each row's last
    real one, sampled with the row's settings; `verify` also returns the argmax at every
    position (speculative verification), else [R, 1] argmax at the last."""
    states = tuple({**p, paged.TABLE: table} for p in pools)
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
def serve_forward_ext(model: Model, pools: tuple, table, tokens, start, n_new, temperature,
                      top_k, top_p, key_data, targets, proc, *, score: bool):
    """`serve_forward` for scoring, logprobs and logit processors (never speculative).

    proc: None, or (counts [R, V], seen [R, V], bias [R, V], presence [R], frequency [R],
    repetition [R]) for `process_logits`. Returns new pools and (sampled [R], greedy
    [R, 1], the sampled token's raw logprob [R], top MAX_LOGPROBS ids / logprobs [R, K]),
    plus with `score` (logprob of `targets` [R, T] at every position, top ids / logprobs
    [R, T, K]). Logprobs are of the model's raw distribution (before processors)."""
    states = tuple({**p, paged.TABLE: table} for p in pools)
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
