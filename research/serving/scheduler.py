"""The engine's scheduling policy (a mixin of `ServingEngine`, research/serving/engine.py):
admission, the prefix / score caches on admission, preemption by recompute, a request's
end and its events, and new tokens -> events (stop ids, stop strings, max tokens).

A mixin rather than an object the engine owns: these methods read and change the same
request table, queue, slots and pool the engine's public primitives (prefill, insert,
generate, fork, abort) do, so the state stays in one place; the attributes it needs are
declared below and set by `ServingEngine.__init__`.
"""
from __future__ import annotations

import collections
import time

from research.decode.paged_pool import PagedPool
from research.kv.block_allocator import OutOfBlocksError
from research.serving.api import TokenEvent, TopLogprobs
from research.serving.engine_state import (ABORTED, DECODING, FINISHED, PREEMPTED, PREFILLING,
                                           QUEUED, DecodeState, LiveRequest, StepStats)
from research.serving.scoring import ScoreCache


class SchedulerMixin:
    pool: PagedPool
    scores: ScoreCache
    state: DecodeState
    step_stats: StepStats
    max_batch: int
    prefill_chunk: int
    max_prefill_rows: int
    _queue: collections.deque
    _live: dict
    _events: list
    _admissions: int
    _preemptions: int

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

    def _prompt_blocks_pending(self, req: LiveRequest) -> int:
        """Fresh blocks `req` still needs to hold its whole prompt and first token."""
        todo = len(req.tokens) + 1 - self.pool.manager.length(req.seq)
        return self.pool.manager.fresh_blocks_needed({req.seq: todo}) if todo > 0 else 0

    def _blocks_promised(self) -> int:
        return sum(self._prompt_blocks_pending(r) for r in self._live.values()
                   if r.state == PREFILLING and r.seq is not None)

    def _start(self, req: LiveRequest, slot: int | None) -> None:
        """Queued/preempted -> prefilling: adopt the cached prefix, reserve the slot."""
        m = self.pool.manager
        first = req.state == QUEUED
        blocks = self.pool.prefix_cache.match(req.tokens) if self.pool.prefix_cache else []
        if req.scoring:
            blocks = self.scores.adopt(req, blocks)
        n_cached = min(len(blocks) * self.pool.block_size, len(req.tokens) - 1)
        if req.scoring and n_cached:  # the logits at the last adopted position are needed
            n_cached -= 1
        n_cached = self.pool.usable_prefix(blocks, n_cached)  # a window's pages may be gone
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

    def _partial_room(self, req: LiveRequest, n: int) -> int:
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

    def _preempt_other(self, req: LiveRequest) -> None:
        victims = [r for r in self._live.values() if r is not req and r.seq is not None]
        if victims:
            self._preempt(max(victims, key=lambda r: r.admitted))

    def _preempt(self, req: LiveRequest) -> None:
        """Preemption by recompute: blocks freed (full ones stay in the prefix cache),
        tokens kept, back to the front of the queue."""
        self._release(req)
        req.state = PREEMPTED
        self._queue.appendleft(req)
        self._preemptions += 1

    def _release(self, req: LiveRequest) -> None:
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

    def _end(self, req: LiveRequest, state: str, token: int | None, text: str, reason: str,
             lp=None, stop_token: int | None = None) -> None:
        self._release(req)
        req.state = state
        self._emit(req, token, text, reason, lp, stop_token)

    def _emit(self, req: LiveRequest, token: int | None, text: str, reason: str | None, lp=None,
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

    # -- tokens -> events -------------------------------------------------------------
    def _accept(self, req: LiveRequest, new: list[int], lps: list | None = None) -> None:
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

    def _cache_new_blocks(self, req: LiveRequest) -> None:
        """Name newly completed full blocks in the prefix cache as they fill."""
        if self.pool.prefix_cache is None or req.seq is None:
            return
        full = self.pool.manager.length(req.seq) // self.pool.block_size
        if full > req.cached_blocks:
            self.pool.cache_blocks(req.seq, req.tokens)
            req.cached_blocks = full

    def _slot_req(self, slot: int) -> LiveRequest | None:
        rid = self.state.slots[slot]
        return None if rid is None else self._live.get(rid)

