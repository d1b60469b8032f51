"""Speculative decoding inside the engine: prompt-lookup drafts for greedy requests,
verified by one forward over [draft..] (the argmax at every position), the accepted
prefix plus the model's own next token kept, the rest rolled back by the caller."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass
class SpecStats:
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0


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


def draft_for(tokens: Sequence[int], *, speculative: int, max_ngram: int, room: int) -> list[int]:
    """A greedy request's draft: up to min(speculative, room) prompt-lookup tokens
    (room: what max_new_tokens and max_len leave after the next token)."""
    k = min(speculative, room)
    return prompt_lookup_draft(tokens, k, max_ngram) if k > 0 else []


def accept_draft(draft: Sequence[int], greedy: np.ndarray, stats: SpecStats) -> list[int]:
    """The new tokens of a verified row: the leading draft tokens the model's argmax
    `greedy` [>= len(draft) + 1] agrees with, then the model's token after them."""
    a = 0
    while a < len(draft) and draft[a] == int(greedy[a]):
        a += 1
    stats.drafted += len(draft)
    stats.accepted += a
    stats.verify_steps += 1
    return list(draft[:a]) + [int(greedy[a])]
