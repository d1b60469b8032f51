"""Prompt scoring inside the engine (SamplingParams.prompt_logprobs): which prompt token
each position of a prefill row predicts, the scores that come back, and the score cache.

A cached K/V block holds no logits, so the engine keeps the per-token results of every
full prompt block it scored, named by the block's chain hash (what the prefix cache
names the block by): a scoring request adopts the longest run of leading blocks found in
both caches, so a shared few-shot prefix is computed once.
"""
from __future__ import annotations

import collections

import numpy as np

from research.kv.prefix_cache import chain_hashes
from research.serving.engine_state import LiveRequest


def score_targets(reqs, start, n_new, t: int) -> np.ndarray:
    """[R, T] int32: row i, column j predicts prompt token start[i] + j + 1 (for rows
    whose request is scoring; 0 elsewhere)."""
    targets = np.zeros((len(reqs), t), np.int32)
    for i, req in enumerate(reqs):
        if req is not None and req.scoring:
            lo, hi = _span(req, start[i], n_new[i])
            targets[i, :max(0, hi - lo)] = req.tokens[lo:hi]
    return targets


def fill_prompt_scores(reqs, start, n_new, tgt_lp, pos_ids, pos_lp) -> None:
    """Put a scoring forward's results ([R, T] logprobs of the targets, [R, T, K] top ids
    / logprobs) into the scoring rows' prompt positions."""
    for i, req in enumerate(reqs):
        if req is None or not req.scoring:
            continue
        lo, hi = _span(req, start[i], n_new[i])
        if hi > lo:
            req.prompt_lp[lo:hi] = tgt_lp[i, :hi - lo]
            req.prompt_top_ids[lo:hi] = pos_ids[i, :hi - lo]
            req.prompt_top_lp[lo:hi] = pos_lp[i, :hi - lo]


def _span(req: LiveRequest, start, n_new) -> tuple[int, int]:
    """The prompt positions [lo, hi) a row's columns predict."""
    return int(start) + 1, min(int(start) + int(n_new) + 1, req.n_prompt)


class ScoreCache:
    """Block chain hash -> (token logprobs [bs], top ids [bs, K], top logprobs [bs, K]),
    least recently used evicted past `capacity` blocks."""

    def __init__(self, block_size: int, capacity: int):
        self.block_size, self.capacity = block_size, capacity
        self._blocks: collections.OrderedDict[int, tuple] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def adopt(self, req: LiveRequest, blocks: list[int]) -> list[int]:
        """The leading `blocks` whose per-token scores are cached (copied into `req`): a
        scoring request adopts only K/V whose logits it need not see."""
        bs = self.block_size
        hashes = chain_hashes(req.tokens[:len(blocks) * bs], bs)
        k = 0
        while k < len(hashes) and hashes[k] in self._blocks:
            lp, ids, tops = self._blocks[hashes[k]]
            self._blocks.move_to_end(hashes[k])
            sl = slice(k * bs, (k + 1) * bs)
            req.prompt_lp[sl], req.prompt_top_ids[sl], req.prompt_top_lp[sl] = lp, ids, tops
            k += 1
        return blocks[:k]

    def store(self, req: LiveRequest) -> None:
        """Keep the per-token scores of `req`'s full prompt blocks."""
        bs = self.block_size
        for k, h in enumerate(chain_hashes(req.tokens[:req.n_prompt], bs)):
            sl = slice(k * bs, (k + 1) * bs)
            if h not in self._blocks:
                self._blocks[h] = (req.prompt_lp[sl].copy(), req.prompt_top_ids[sl].copy(),
                                   req.prompt_top_lp[sl].copy())
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
