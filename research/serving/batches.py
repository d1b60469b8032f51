"""The engine's batches (a mixin of `ServingEngine`, research/serving/engine.py): one
decode step over the slots (with prompt-lookup drafts verified in the same forward) and
one prefill forward over chunks of prompts, each built as host arrays (tokens, start
positions, new-token counts, block table), run by the engine's `StepRunner` and handed
to the scheduler's `_accept`.

A mixin for the reason scheduler.py gives: the batches read and change the engine's one
request table, slots and pool.
"""
from __future__ import annotations

import numpy as np

from research.decode.paged_pool import PagedPool, pow2
from research.kv.block_allocator import OutOfBlocksError
from research.serving.engine_state import (ABORTED, DECODING, FINISHED, PREFILLING, DecodeState,
                                           LiveRequest, Prefix)
from research.serving.speculative import SpecStats, accept_draft, draft_for


class BatchMixin:
    pool: PagedPool
    state: DecodeState
    spec_stats: SpecStats
    max_batch: int
    max_len: int
    prefill_chunk: int
    max_prefill_rows: int
    speculative: int
    max_ngram: int
    _live: dict
    _last_decode_tokens: int

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
                new = accept_draft(d, greedy[r.slot], self.spec_stats)
                m.truncate(r.seq, int(start[r.slot]) + len(new))  # the rejected rolled back
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

    def _draft(self, req: LiveRequest) -> list[int]:
        if not self.speculative or req.params.temperature != 0 or req.extended:
            return []
        room = min(req.params.max_new_tokens - req.n_generated - 1,
                   self.max_len - len(req.tokens))
        return draft_for(req.tokens, speculative=self.speculative, max_ngram=self.max_ngram,
                         room=room)

    # -- prefill ----------------------------------------------------------------------
    def _forward_prefill(self, rows: list[tuple[LiveRequest, int]]) -> None:
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

    def _after_prefill(self, req: LiveRequest, sampled: int, lp) -> None:
        """A prefill row's results: the first token once the whole prompt is computed."""
        if self.pool.manager.length(req.seq) == len(req.tokens):  # the whole context
            if req.scoring:
                self.scores.store(req)
            if req.params.max_new_tokens == 0:  # scoring only: a prefill, no decode
                self._end(req, FINISHED, None, "", "length")
                return
            self._accept(req, [sampled], [lp] if lp is not None else None)
            if req.state == PREFILLING and req.slot is not None:
                self.insert(self._prefix(req), req.slot)
        else:
            self._cache_new_blocks(req)

    def _prefix(self, req: LiveRequest) -> Prefix:
        done = req.state in (FINISHED, ABORTED)
        return Prefix(req.rid, len(req.tokens) - 1, req.n_cached,
                      None if done else req.tokens[-1], done)

