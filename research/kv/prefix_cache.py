"""Prefix cache over the paged block pool: full blocks found again by their contents.

A full block of a sequence is named by a chain hash: hash(parent block's hash, the
block's tokens), so a hash names the whole token prefix up to the end of that block, not
only the block's own tokens (the same tokens after a different prefix have different
K/V). The cache maps hash -> block id and holds one reference on every block it names
(`BlockAllocator` counts), so a cached block outlives the sequence that wrote it.

- `match(tokens)`: the longest run of leading full blocks of `tokens` found in the cache
  (longest-prefix match); each entry also stores its parent hash and its tokens, and a
  hit compares them, so a hash collision can never serve the wrong K/V.
- `insert(tokens, blocks, n_computed)`: name the full blocks of a sequence whose K/V are
  computed (first `n_computed` tokens), so later requests can share them.
- Eviction: a block only the cache references (count 1) is *evictable*; `evict(n)` frees
  the least recently used of them (LRU; a hit or insert refreshes an entry). Blocks a
  live sequence references are never evicted.

Only full blocks are named: a partial block may still be written, a full one never is.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

from research.kv.block_allocator import BlockAllocator

ROOT_HASH = 0


@dataclasses.dataclass(frozen=True)
class _Entry:
    block: int
    parent: int  # the parent block's chain hash (ROOT_HASH for a first block)
    tokens: tuple[int, ...]


def chain_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chain hash of each full block of `tokens` (the block's tokens after its prefix)."""
    hashes, parent = [], ROOT_HASH
    for i in range(len(tokens) // block_size):
        parent = hash((parent, tuple(int(t) for t in tokens[i * block_size:(i + 1) * block_size])))
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Hash-named full blocks of one `BlockAllocator`, reference-counted, LRU-evicted."""

    def __init__(self, allocator: BlockAllocator, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.allocator = allocator
        self.block_size = block_size
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._hash_of: dict[int, int] = {}  # block -> its hash (a block has one name)
        self.queries = 0  # tokens looked up (full blocks only)
        self.hits = 0  # tokens found
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block: int) -> bool:
        return block in self._hash_of

    @property
    def n_evictable(self) -> int:
        return sum(self.allocator.refcount(e.block) == 1 for e in self._entries.values())

    def tokens_of(self, block: int) -> tuple[int, ...]:
        """The tokens the cached `block` is named by (KeyError if not cached)."""
        return self._entries[self._hash_of[block]].tokens

    def match(self, tokens: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached run of leading full blocks of `tokens`."""
        blocks, parent = [], ROOT_HASH
        n_full = len(tokens) // self.block_size
        for i, h in enumerate(chain_hashes(tokens, self.block_size)):
            entry = self._entries.get(h)
            want = tuple(int(t) for t in tokens[i * self.block_size:(i + 1) * self.block_size])
            if entry is None or entry.parent != parent or entry.tokens != want:
                break
            self._entries.move_to_end(h)
            blocks.append(entry.block)
            parent = h
        self.queries += n_full * self.block_size
        self.hits += len(blocks) * self.block_size
        return blocks

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], n_computed: int) -> int:
        """Name the full, computed blocks of a sequence (tokens[i] lives in
        blocks[i // block_size]); returns how many blocks were newly cached."""
        n_full = min(n_computed, len(tokens)) // self.block_size
        if len(blocks) < n_full:
            raise ValueError(f"{n_full} full blocks computed but only {len(blocks)} given")
        added, parent = 0, ROOT_HASH
        for i, h in enumerate(chain_hashes(tokens[:n_full * self.block_size], self.block_size)):
            block = int(blocks[i])
            entry = self._entries.get(h)
            if entry is not None:  # already named (maybe by another block holding the same)
                self._entries.move_to_end(h)
            elif block not in self._hash_of:
                toks = tuple(int(t) for t in tokens[i * self.block_size:(i + 1) * self.block_size])
                self.allocator.incref(block)
                self._entries[h] = _Entry(block, parent, toks)
                self._hash_of[block] = h
                added += 1
            parent = h
        return added

    def evict(self, n: int) -> int:
        """Free up to `n` evictable blocks, least recently used first; returns how many."""
        freed = 0
        for h in list(self._entries):
            if freed >= n:
                break
            entry = self._entries[h]
            if self.allocator.refcount(entry.block) == 1:
                del self._entries[h], self._hash_of[entry.block]
                self.allocator.decref(entry.block)
                freed += 1
        self.evictions += freed
        return freed

    def clear(self) -> int:
        """Evict every evictable block (referenced ones stay cached)."""
        return self.evict(len(self._entries))
