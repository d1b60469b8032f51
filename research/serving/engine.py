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

The engine's parts: ServingEngine (here) holds the public surface (driver loop,
MaxEngine primitives, forks, warm-up, metrics), the forward calls' host side and the
request checks; two mixins share its state (one request table, queue, slots and pool),
and it owns the rest as objects:
  scheduler.py     SchedulerMixin: admission, preemption, a request's end, tokens -> events
  batches.py       BatchMixin: the decode step (with drafts) and the prefill chunks
  step_runner.py   StepRunner: the forward calls (serve_forward / serve_forward_ext), read
                   buckets, StepStats; compile_count
  engine_state.py  LiveRequest, Prefix, DecodeState, StepStats, RequestFailed, the states
  speculative.py   prompt-lookup drafts and their verification (SpecStats)
  scoring.py       prompt scoring targets / results and the ScoreCache
  validation.py    the checks `add_request` runs (RequestError naming the field)
  text_stream.py   TextStream: detokenized increments and stop strings
The per-row array builders (`sampling_rows`, `processor_rows`, `token_key`) stay here.

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
import time
from typing import Sequence

import numpy as np

from research.decode.paged_pool import PagedPool, codec_window, pow2
from research.kv.block_allocator import OutOfBlocksError
from research.model.llama import Model
from research.serving.api import EngineMetrics, QueueFullError, Request, TokenEvent
from research.serving.batches import BatchMixin
from research.serving.engine_state import (ABORTED, DECODING, PREFILLING, DecodeState,
                                           LiveRequest, Prefix, RequestFailed, StepStats)
from research.serving.scheduler import SchedulerMixin
from research.serving.scoring import ScoreCache, fill_prompt_scores, score_targets
from research.serving.speculative import SpecStats, prompt_lookup_draft
from research.serving.step_runner import (StepRunner, compile_count, serve_forward,
                                          serve_forward_ext)
from research.serving.text_stream import TextStream
from research.serving.validation import live_request

# the engine's public names that live in its parts (tests and experiments import them here)
__all__ = ["ServingEngine", "Prefix", "DecodeState", "StepStats", "SpecStats", "TextStream",
           "RequestFailed", "prompt_lookup_draft", "serve_forward", "serve_forward_ext",
           "sampling_rows", "processor_rows", "token_key", "compile_count"]


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


def window_pages_for(model: Model, block_size: int, rows: int) -> int:
    """Window pages a pool needs for a windowed codec (0: none): per sequence its sink's
    blocks, the blocks of its last W tokens read in a pass and of those the pass writes,
    and a block of slack each side (research/kv/window_pages.py), for `rows` sequences."""
    window = codec_window(model)
    if window is None:
        return 0
    sink, recent = window
    return rows * (-(-sink // block_size) + 2 * -(-recent // block_size) + 4)


class ServingEngine(SchedulerMixin, BatchMixin):
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
                              rules=rules, window_blocks=window_pages_for(
                                  model, block_size, 2 * max_batch))
        # the forward calls; a model holding one weight set per phase (research.dynacore)
        # prefills with its prefill set and decodes with its decode set
        self.runner = StepRunner(self.pool, min_read_len=min_read_len)
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
        self._last_decode_tokens = 0
        self._queue: collections.deque[LiveRequest] = collections.deque()
        self._live: dict[str, LiveRequest] = {}  # every request holding blocks or a slot
        self._events: list[TokenEvent] = []
        self._admissions = 0
        self._preemptions = 0
        self._compiles0 = compile_count()
        self.warmup_scoring = warmup_scoring
        self.scores = ScoreCache(block_size, capacity=n_blocks)  # prompt scores per block
        if warmup:
            self.warmup()

    @property
    def step_stats(self) -> StepStats:
        return self.runner.stats

    @step_stats.setter
    def step_stats(self, stats: StepStats) -> None:
        self.runner.stats = stats

    @property
    def _phase_models(self) -> dict:
        return self.runner.phase_models

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
        return self.runner.table_widths()

    def _table_width(self, n_blocks: int) -> int:
        return self.runner.table_width(n_blocks)

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

    # -- the forward call -------------------------------------------------------------
    def _run_forward(self, tokens, start, n_new, table, reqs, *, verify: bool, phase: str):
        """Forward + per-row sampling; returns (sampled [R], greedy [R, T]) on the host.
        phase: "prefill" or "decode", the model view that runs (Model.for_phase).
        reqs[i]: the request of row i (None = padding); its next token's position is
        start + n_new (keys from (seed, position))."""
        try:
            sampling = sampling_rows(reqs, start, n_new)
        except RequestFailed:
            self._roll_back(reqs, start)
            raise
        return self.runner.run(tokens, start, n_new, table, sampling, verify=verify,
                               phase=phase)

    def _run_forward_ext(self, tokens, start, n_new, table, reqs, *, phase: str,
                         score: bool, process: bool | None = None):
        """`_run_forward` for batches with scoring / logprobs / logit processors: returns
        (sampled [R], greedy [R, 1], per row (logprob, top pairs) of its sampled token);
        with `score`, the scoring rows' prompt positions are filled in as a side effect."""
        rows, t = tokens.shape
        if process is None:
            process = any(r is not None and r.params.processed for r in reqs)
        try:
            sampling = sampling_rows(reqs, start, n_new)
            targets = (score_targets(reqs, start, n_new, t) if score
                       else np.zeros((rows, t), np.int32))
            proc = processor_rows(reqs, start, n_new, self.vocab_size) if process else None
        except RequestFailed:
            self._roll_back(reqs, start)
            raise
        out = self.runner.run_ext(tokens, start, n_new, table, sampling, targets, proc,
                                  phase=phase, score=score)
        sampled, greedy, lp, top_ids, top_lp = out[:5]
        if score:
            fill_prompt_scores(reqs, start, n_new, *out[5:])
        lps = [(float(lp[i]), tuple(zip(top_ids[i].tolist(), top_lp[i].tolist())))
               for i in range(rows)]
        return sampled, greedy, lps

    # -- validation -------------------------------------------------------------------
    def _validated(self, request: Request) -> LiveRequest:
        rid = getattr(request, "request_id", None)
        taken = isinstance(rid, str) and (rid in self._live
                                          or any(r.rid == rid for r in self._queue))
        req = live_request(request, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                           max_len=self.max_len, stop_token_ids=self.stop_token_ids,
                           taken=taken)
        self._build_rows(req)
        return req

    def _build_rows(self, req: LiveRequest) -> None:
        """Build `req`'s rows of a forward once, alone, so that a setting which does not
        fit the per-row arrays fails its request here rather than a shared step later."""
        zero = np.zeros(1, np.int32)
        try:
            sampling_rows([req], zero, zero)
            if req.params.processed:
                processor_rows([req], zero, zero, self.vocab_size)
        except RequestFailed as e:
            raise e.__cause__ from None
