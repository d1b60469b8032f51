"""Host-side bookkeeping of a paged KV cache: a reference-counted block pool and block tables.

The device holds, per layer, a pool of `n_blocks` blocks of `block_size` token slots
(`research/kv/paged.py`). This module decides which block holds which sequence's tokens:

- `BlockAllocator`: a free list plus a reference count per block. A block returns to the
  free list exactly when its count drops to zero; decrementing a free block is an error
  (a double free), never silently ignored.
- `BlockManager`: per-sequence block tables and lengths on top of the allocator.
  `fork` shares every block of the parent (count + 1 each, no copy). Appending to a
  sequence whose partially-filled last block is shared copies that block first
  (copy-on-write): the copy is returned as a `(src, dst)` pair for the device to
  execute before the next forward pass. Full blocks are never copied, because no
  sequence ever writes into a full block again.

Out of blocks: `append`/`reserve` check the whole request against the free list before
touching anything and raise `OutOfBlocksError` (state unchanged), so a caller can
preempt (free or truncate other sequences) and retry. Nothing is ever overwritten.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy as np


class OutOfBlocksError(RuntimeError):
    """The pool has too few free blocks for a request; no state was changed."""


class BlockAllocator:
    """Reference-counted pool of block ids 0..n_blocks-1."""

    def __init__(self, n_blocks: int):
        if n_blocks < 1:
            raise ValueError(f"n_blocks must be >= 1, got {n_blocks}")
        self.n_blocks = n_blocks
        self._refcount = np.zeros(n_blocks, np.int64)
        # Pop from the end: lowest ids first, so small workloads use a compact range.
        self._free = list(range(n_blocks - 1, -1, -1))
        self.peak_used = 0
        # called with a block id when it returns to the free list (a paged pool frees
        # what it keeps per block beside the pages: a windowed codec's window page)
        self.on_free = None

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        return self.n_blocks - len(self._free)

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return int(self._refcount[block])

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocksError(f"all {self.n_blocks} KV blocks are in use")
        block = self._free.pop()
        self._refcount[block] = 1
        self.peak_used = max(self.peak_used, self.n_used)
        return block

    def incref(self, block: int) -> None:
        self._check_id(block)
        if self._refcount[block] <= 0:
            raise ValueError(f"incref of free block {block}: only allocated blocks can be shared")
        self._refcount[block] += 1

    def decref(self, block: int) -> bool:
        """Drop one reference; returns True when the block went back to the free list."""
        self._check_id(block)
        if self._refcount[block] <= 0:
            raise ValueError(f"double free: block {block} has no references")
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            self._free.append(block)
            if self.on_free is not None:
                self.on_free(block)
            return True
        return False

    def check_consistency(self) -> None:
        """Free list and counts agree (every block is free xor referenced, no duplicates)."""
        free = np.zeros(self.n_blocks, bool)
        for b in self._free:
            if free[b]:
                raise AssertionError(f"block {b} is on the free list twice")
            free[b] = True
        if np.any(free & (self._refcount != 0)) or np.any(~free & (self._refcount <= 0)):
            raise AssertionError("free list and reference counts disagree")

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.n_blocks:
            raise ValueError(f"block id {block} outside [0, {self.n_blocks})")


@dataclasses.dataclass
class _Sequence:
    blocks: list[int]
    length: int


class BlockManager:
    """Block tables of live sequences over one `BlockAllocator`.

    Sequence ids are ints handed out by `new_sequence`/`fork`. All methods either succeed
    completely or raise before changing anything.
    """

    def __init__(self, n_blocks: int, block_size: int, max_blocks_per_seq: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq must be >= 1, got {max_blocks_per_seq}")
        self.allocator = BlockAllocator(n_blocks)
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0
        self.cow_copies = 0  # blocks copied on write so far (a sharing-cost metric)

    # -- queries ----------------------------------------------------------------------
    @property
    def max_len(self) -> int:
        return self.block_size * self.max_blocks_per_seq

    def __contains__(self, seq: int) -> bool:
        return seq in self._seqs

    def live_sequences(self) -> list[int]:
        return list(self._seqs)

    def length(self, seq: int) -> int:
        return self._get(seq).length

    def blocks(self, seq: int) -> tuple[int, ...]:
        return tuple(self._get(seq).blocks)

    def block_table(self, seqs: Sequence[int], n_rows: int | None = None) -> np.ndarray:
        """[n_rows, max_blocks_per_seq] int32 table; unused entries and padding rows = -1."""
        n_rows = len(seqs) if n_rows is None else n_rows
        if n_rows < len(seqs):
            raise ValueError(f"n_rows={n_rows} is smaller than the {len(seqs)} sequences")
        table = np.full((n_rows, self.max_blocks_per_seq), -1, np.int32)
        for row, seq in enumerate(seqs):
            blocks = self._get(seq).blocks
            table[row, :len(blocks)] = blocks
        return table

    # -- lifecycle --------------------------------------------------------------------
    def new_sequence(self) -> int:
        return self._add(_Sequence([], 0))

    def adopt(self, blocks: Sequence[int], length: int) -> int:
        """A new sequence of `length` tokens whose KV already lies in `blocks` (a prefix
        cache hit): each block gains a reference, nothing is copied. Writing past
        `length` into a shared partial last block copies it first, as after `fork`."""
        blocks = [int(b) for b in blocks]
        if len(blocks) > self.max_blocks_per_seq:
            raise ValueError(f"{len(blocks)} blocks exceed max_blocks_per_seq="
                             f"{self.max_blocks_per_seq}")
        if self._blocks_for(length) != len(blocks):
            raise ValueError(f"length {length} needs {self._blocks_for(length)} blocks of "
                             f"{self.block_size}, got {len(blocks)}")
        for b in blocks:
            if self.allocator.refcount(b) <= 0:
                raise ValueError(f"adopt of free block {b}: only allocated blocks hold KV")
        for b in blocks:
            self.allocator.incref(b)
        return self._add(_Sequence(blocks, length))

    def fork(self, seq: int) -> int:
        """A new sequence sharing all of `seq`'s blocks (copy-on-write)."""
        parent = self._get(seq)
        for b in parent.blocks:
            self.allocator.incref(b)
        return self._add(_Sequence(list(parent.blocks), parent.length))

    def fork_copy(self, seq: int) -> tuple[int, list[tuple[int, int]]]:
        """A new sequence with private copies of all of `seq`'s blocks (no sharing).

        The no-sharing baseline: same contents as `fork`, but every block is duplicated;
        returns the new id and the (src, dst) copies the device must execute.
        """
        parent = self._get(seq)
        if len(parent.blocks) > self.allocator.n_free:
            raise OutOfBlocksError(
                f"need {len(parent.blocks)} free KV blocks to copy sequence {seq}, only "
                f"{self.allocator.n_free} of {self.allocator.n_blocks} are free")
        blocks = [self.allocator.allocate() for _ in parent.blocks]
        return self._add(_Sequence(blocks, parent.length)), list(zip(parent.blocks, blocks))

    def free(self, seq: int) -> None:
        for b in self._get(seq).blocks:
            self.allocator.decref(b)
        del self._seqs[seq]

    def truncate(self, seq: int, length: int) -> None:
        """Roll `seq` back to its first `length` tokens, releasing blocks past them."""
        s = self._get(seq)
        if not 0 <= length <= s.length:
            raise ValueError(f"truncate length must be in [0, {s.length}], got {length}")
        keep = self._blocks_for(length)
        for b in s.blocks[keep:]:
            self.allocator.decref(b)
        del s.blocks[keep:]
        s.length = length

    # -- growth -----------------------------------------------------------------------
    def blocks_needed(self, seq: int, n_tokens: int) -> int:
        """Fresh blocks `append(seq, n_tokens)` would take from the free list."""
        s = self._get(seq)
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        if s.length + n_tokens > self.max_len:
            raise ValueError(f"sequence {seq} would reach {s.length + n_tokens} tokens, "
                             f"more than max_len={self.max_len} "
                             f"({self.max_blocks_per_seq} blocks of {self.block_size})")
        if n_tokens == 0:
            return 0
        new = self._blocks_for(s.length + n_tokens) - len(s.blocks)
        return new + int(self._needs_cow(s))

    def append(self, seq: int, n_tokens: int) -> list[tuple[int, int]]:
        """Make room for `n_tokens` more tokens; returns copy-on-write (src, dst) pairs."""
        return self.reserve({seq: n_tokens})

    def reserve(self, requests: dict[int, int] | Iterable[tuple[int, int]]
                ) -> list[tuple[int, int]]:
        """`append` for several sequences at once, all or nothing."""
        requests = dict(requests)
        needed = self._fresh_blocks_needed(requests)
        if needed > self.allocator.n_free:
            raise OutOfBlocksError(
                f"need {needed} free KV blocks for {len(requests)} sequences, only "
                f"{self.allocator.n_free} of {self.allocator.n_blocks} are free; free or "
                "truncate sequences (preempt) and retry, or build a larger pool")
        copies = []
        for seq, n in requests.items():
            if n == 0:
                continue
            s = self._seqs[seq]
            if self._needs_cow(s):
                src = s.blocks[-1]
                dst = self.allocator.allocate()
                self.allocator.decref(src)
                s.blocks[-1] = dst
                copies.append((src, dst))
                self.cow_copies += 1
            while len(s.blocks) < self._blocks_for(s.length + n):
                s.blocks.append(self.allocator.allocate())
            s.length += n
        return copies

    def fresh_blocks_needed(self, requests: dict[int, int] | Iterable[tuple[int, int]]
                            ) -> int:
        """Free blocks `reserve(requests)` would take (copy-on-write included)."""
        return self._fresh_blocks_needed(dict(requests))

    # -- internals --------------------------------------------------------------------
    def _fresh_blocks_needed(self, requests: dict[int, int]) -> int:
        """Exact count for a batch: of k sharers of one partial block appending together,
        the last one to copy finds itself the sole owner and writes in place."""
        needed, refs = 0, {}
        for seq, n in requests.items():
            total = self.blocks_needed(seq, n)  # also validates seq and n
            if n == 0:
                continue
            s = self._seqs[seq]
            cow = self._needs_cow(s)
            needed += total - int(cow)
            if cow:
                last = s.blocks[-1]
                refs.setdefault(last, self.allocator.refcount(last))
                if refs[last] > 1:
                    needed += 1
                    refs[last] -= 1
        return needed

    def _needs_cow(self, s: _Sequence) -> bool:
        """The next token lands in a partially-filled block someone else also holds."""
        partial = s.length % self.block_size != 0
        return bool(partial and s.blocks and self.allocator.refcount(s.blocks[-1]) > 1)

    def _blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def _add(self, s: _Sequence) -> int:
        seq = self._next_id
        self._next_id += 1
        self._seqs[seq] = s
        return seq

    def _get(self, seq: int) -> _Sequence:
        try:
            return self._seqs[seq]
        except KeyError:
            raise ValueError(f"unknown or freed sequence id {seq}") from None
