"""Host bookkeeping of a windowed codec's bfloat16 window pages in a paged pool.

A windowed codec (research/kv/windowed.py) reads a query's first S tokens and its last W
tokens from bfloat16 copies, the rest from codes. In the paged layout the codes live in
the main pool (every token), the copies in a second, small pool of window pages
(research/kv/paged.py, "window_table"). This module decides which main-pool block has a
window page:

- A window page belongs to one main-pool block (its *shadow*): sequences that share the
  block (fork, prefix cache) share its page, copy-on-write copies the page with the
  block, and freeing the block frees its page (`BlockAllocator.on_free`).
- A pass's row from position a to b (n_new = b - a tokens) needs pages for the blocks it
  reads in full precision that were written before it (the sink's, and [a - W + 1, a))
  and for those it writes that stay in the window (the sink's, and [b - W, b)); its own
  chunk it reads from the chunk. `pass_table` maps those, allocating missing pages for
  blocks being written, and raises if a block to be *read* has none (never a silent
  read of a stale page).
- Before each pass, pages no live sequence can read again are freed (`sweep`): a block
  that left every holder's window never re-enters it. Sink blocks keep their pages while
  the block is allocated, so a prefix-cache hit finds its sink; a hit is used only as far
  as its window's pages still exist (`usable_prefix`), the rest is recomputed.
"""
from __future__ import annotations

import numpy as np

from research.kv.block_allocator import BlockAllocator, BlockManager, OutOfBlocksError


class WindowPages:
    """Window pages of `n_pages` for the blocks of `manager` (module docstring)."""

    def __init__(self, manager: BlockManager, n_pages: int, *, sink: int, recent: int):
        self.manager = manager
        self.block_size = manager.block_size
        self.sink, self.recent = sink, recent
        self.pages = BlockAllocator(n_pages)
        self.page_of: dict[int, int] = {}  # main-pool block -> its window page
        self.index_of: dict[int, int] = {}  # main-pool block -> its index in a sequence
        if manager.allocator.on_free is not None:
            raise ValueError("the block allocator already reports frees to another owner")
        manager.allocator.on_free = self._drop

    # -- which blocks ---------------------------------------------------------------------
    def _blocks(self, lo: int, hi: int) -> range:
        """Block indices holding positions [lo, hi) (empty when hi <= lo)."""
        lo = max(lo, 0)
        return range(lo // self.block_size, -(-hi // self.block_size)) if hi > lo else range(0)

    def read_blocks(self, length: int) -> set[int]:
        """Blocks a pass starting at `length` reads in full precision from pages."""
        return (set(self._blocks(0, min(self.sink, length)))
                | set(self._blocks(length - self.recent + 1, length)))

    def write_blocks(self, start: int, end: int) -> set[int]:
        """Blocks whose tokens written in [start, end) are read in full precision later."""
        return (set(self._blocks(start, min(self.sink, end)))
                | set(self._blocks(max(start, end - self.recent), end)))

    def is_sink(self, index: int) -> bool:
        return index * self.block_size < self.sink

    # -- per pass -------------------------------------------------------------------------
    def pass_table(self, table: np.ndarray, start: np.ndarray, n_new: np.ndarray) -> np.ndarray:
        """The window table [R, M] of a pass over `table` (rows with n_new = 0: none)."""
        rows = [(r, int(start[r]), int(start[r] + n_new[r])) for r in range(table.shape[0])
                if n_new[r] > 0]
        self.sweep(keep={int(table[r, j]) for r, a, b in rows
                         for j in self.read_blocks(a) | self.write_blocks(a, b)})
        out = np.full(table.shape, -1, np.int32)
        for r, a, b in rows:
            for j in sorted(self.read_blocks(a)):
                block = int(table[r, j])
                if block not in self.page_of:
                    raise RuntimeError(
                        f"row {r} reads block {block} (positions {j * self.block_size}+) in "
                        "full precision but it has no window page: its copies were freed")
                out[r, j] = self.page_of[block]
            for j in sorted(self.write_blocks(a, b)):
                block = int(table[r, j])
                page = self.page_of.get(block)
                out[r, j] = page if page is not None else self._allocate(block, j)
        return out

    def sweep(self, keep: set[int] = frozenset()) -> int:
        """Free the pages of blocks no live sequence can read in full precision again
        (besides `keep`'s and sink blocks'); returns how many were freed."""
        needed = set(keep)
        m = self.manager
        for seq in m.live_sequences():
            blocks, length = m.blocks(seq), m.length(seq)
            # a rollback (speculative drafts) may move the window back by a block
            for j in self.read_blocks(length) | set(self._blocks(
                    length - self.recent - self.block_size, length)):
                if j < len(blocks):
                    needed.add(blocks[j])
        drop = [b for b in self.page_of if b not in needed and not self.is_sink(
            self.index_of[b])]
        for b in drop:
            self._drop(b)
        return len(drop)

    def copy(self, copies: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Window-page copies for main-pool copies (src, dst): a copied block keeps its
        page's contents (copy-on-write of a window block)."""
        out = []
        for src, dst in copies:
            if src in self.page_of:
                out.append((self.page_of[src], self._allocate(dst, self.index_of[src])))
        return out

    def usable_prefix(self, blocks, n_cached: int) -> int:
        """The longest prefix <= n_cached of cached `blocks` whose full-precision reads
        (sink, last W tokens) still have their window pages."""
        candidates = [n_cached] + list(range((n_cached - 1) // self.block_size
                                             * self.block_size, -1, -self.block_size))
        for length in candidates:
            if all(j < len(blocks) and blocks[j] in self.page_of
                   for j in self.read_blocks(length)):
                return length
        return 0

    # -- pages ----------------------------------------------------------------------------
    def _allocate(self, block: int, index: int) -> int:
        """A page for `block` (which has none: a block gets one once, freed with it)."""
        if not self.pages.n_free:
            self._drop_cached_sinks()
        if not self.pages.n_free:
            raise OutOfBlocksError(f"all {self.pages.n_blocks} window pages are in use: "
                                   "build the pool with more window_blocks")
        self.page_of[block] = self.pages.allocate()
        self.index_of[block] = index
        return self.page_of[block]

    def _drop_cached_sinks(self) -> None:
        """Under pressure: free the sink pages of blocks no live sequence holds."""
        held = {b for s in self.manager.live_sequences() for b in self.manager.blocks(s)}
        for b in [b for b in self.page_of if b not in held]:
            self._drop(b)

    def _drop(self, block: int) -> None:
        page = self.page_of.pop(block, None)
        self.index_of.pop(block, None)
        if page is not None:
            self.pages.decref(page)

    def check_consistency(self) -> None:
        """Every page belongs to one allocated block; free pages are exactly the rest."""
        self.pages.check_consistency()
        owned = list(self.page_of.values())
        if len(set(owned)) != len(owned):
            raise AssertionError("a window page belongs to two blocks")
        if self.pages.n_used != len(owned):
            raise AssertionError(f"{self.pages.n_used} window pages in use, "
                                 f"{len(owned)} owned by blocks")
        for b in self.page_of:
            if self.manager.allocator.refcount(b) <= 0:
                raise AssertionError(f"free block {b} still has a window page")
