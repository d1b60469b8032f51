"""One paged KV pool shared by every engine: the paged model, its device pools, the host
block manager and (optionally) the prefix cache.

The serving engine (`research.serving.engine.ServingEngine`) and SpecScale's search
engine (`research.specscale.engine.PagedEngine`) both keep their K/V here; the model and
cache state live in this one object (where a later sharding change puts its mesh).

    pool = PagedPool(model, n_blocks=512, block_size=16, max_len=1024, prefix_cache=True)
    seq = pool.manager.new_sequence()
    pool.reserve({seq: n})                # blocks (evicting cached ones if needed) + CoW
    table = pool.block_table([seq], rows=8, width=pool.max_blocks)
    pool.pools = some_forward(pool.model, pool.pools, table, ...)   # donated, replaced
"""
from __future__ import annotations

import jax
import numpy as np

from research.kv import paged
from research.kv.block_allocator import BlockManager, OutOfBlocksError
from research.kv.prefix_cache import PrefixCache
from research.kv.window_pages import WindowPages
from research.kv.windowed import is_windowed
from research.model.llama import Model


def pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def codec_window(model: Model) -> tuple[int, int] | None:
    """(sink, recent) of a model whose every layer has a windowed codec, None when none
    has; a ValueError for a mix (one window pool serves every layer)."""
    windows = {(c.codec.sink, c.codec.recent) if is_windowed(getattr(c, "codec", None))
               else None for c in model.caches}
    if len(windows) > 1:
        raise ValueError(f"every layer must have the same full-precision window (or none), "
                         f"got {sorted(map(str, windows))}")
    return windows.pop()


class PagedPool:
    """Paged K/V of `n_blocks` blocks of `block_size` tokens for any codec-cache model.

    model: any servax Model whose caches are codecs in a layout (float32/bf16, int8,
      TaSQ/VQ, CQ, sign-bit; weights transformed or not); each layer's records move into
      pages of one pool with its codec kept. A cache that cannot be paged (an eviction
      press, KIVI's residual ring) is refused, naming it.
    max_len: longest sequence (the block-table width is ceil(max_len / block_size)).
    prefix_cache: keep full blocks named by their token prefix after their sequence ends
      (`research.kv.prefix_cache`); evicted LRU when the free list runs short.
    mesh: serve from sharded state (`research.sharding`): params split by `rules`
      (default `POOL_RULES`: heads, FFN columns and vocabulary over "tensor", experts over
      "expert"), the pool split by KV heads. Rows are not split: every row may map any
      block (prefix sharing, rows re-bound each pass), so a mesh with a data axis > 1 is
      refused (run one pool per data-parallel replica).
    """

    def __init__(self, model: Model, *, n_blocks: int, block_size: int = 16,
                 max_len: int = 512, implementation: str = "auto", interpret: bool = False,
                 prefix_cache: bool = False, mesh=None, rules=None, window_blocks: int = 0):
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        if max_len > model.config.max_position:
            raise ValueError(f"max_len={max_len} exceeds the model's max_position="
                             f"{model.config.max_position}")
        self.window = codec_window(model)
        if self.window is not None and window_blocks < 1:
            raise TypeError(f"a paged pool serves {model.caches[0].codec.describe()} only "
                            "with window pages for its bfloat16 sink and recent tokens: "
                            "pass window_blocks >= 1 (the serving engine sizes them)")
        transform = paged.paged_kv_cache(block_size, n_blocks, implementation, interpret,
                                         window_blocks=window_blocks if self.window else 0)
        self.model = transform.apply(model, transform.calibrate(model, None))
        self.mesh = mesh
        if mesh is not None:
            from research.sharding import POOL_RULES, check_pool_mesh, shard_model
            rules = POOL_RULES if rules is None else rules
            check_pool_mesh(mesh, rules)
            self.model = shard_model(self.model, mesh, rules)
        elif rules is not None:
            raise ValueError("rules without a mesh: pass mesh= too")
        self.block_size = block_size
        self.max_blocks = -(-max_len // block_size)
        self.max_len = max_len
        self.manager = BlockManager(n_blocks, block_size, self.max_blocks)
        states = self.model.init_cache(1, max_len)
        for i, (cache, s) in enumerate(zip(self.model.caches, states)):
            if paged.has_seq_state(s):  # rows are re-bound to sequences every pass here
                raise TypeError(f"a paged pool cannot serve layer {i}'s {cache.describe()}: "
                                "its codec keeps per-sequence state outside the pages "
                                "(a full-precision ring), and engines re-bind rows "
                                "to sequences every pass")
        self.pools = tuple(paged.pools_of(s) for s in states)
        codes = [paged.split_window_records(p)[0] for p in self.pools]
        windows = [paged.split_window_records(p)[1] for p in self.pools]
        self.block_bytes = sum(x.nbytes for x in jax.tree.leaves(codes)) // n_blocks
        # a windowed codec's bf16 window pages: their own pool and host bookkeeping
        self.window_pages = (WindowPages(self.manager, window_blocks, sink=self.window[0],
                                         recent=self.window[1]) if self.window else None)
        self.window_bytes = sum(x.nbytes for x in jax.tree.leaves(windows))
        self.prefix_cache = (PrefixCache(self.manager.allocator, block_size)
                             if prefix_cache else None)
        self.block_copies = 0  # copy-on-write / no-sharing copies executed on device

    @property
    def allocator(self):
        return self.manager.allocator

    @property
    def n_blocks(self) -> int:
        return self.manager.allocator.n_blocks

    def n_available(self) -> int:
        """Blocks a reservation can get: free ones plus evictable cached ones."""
        cached = self.prefix_cache.n_evictable if self.prefix_cache is not None else 0
        return self.allocator.n_free + cached

    def blocks_in_use(self) -> int:
        """Blocks live sequences reference (evictable cached blocks excluded)."""
        cached = self.prefix_cache.n_evictable if self.prefix_cache is not None else 0
        return self.allocator.n_used - cached

    def make_room(self, n_free: int) -> bool:
        """Evict cached blocks until `n_free` blocks are free; False if impossible."""
        short = n_free - self.allocator.n_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)
        return self.allocator.n_free >= n_free

    def reserve(self, requests: dict[int, int]) -> None:
        """Room for requests[seq] more tokens of each sequence, all or nothing; runs the
        copy-on-write copies on device. Raises OutOfBlocksError (nothing changed) when
        even evicting every evictable cached block is not enough."""
        needed = self.manager.fresh_blocks_needed(requests)
        if not self.make_room(needed):
            raise OutOfBlocksError(f"need {needed} free KV blocks, only "
                                   f"{self.allocator.n_free} free of {self.n_blocks}")
        self.copy(self.manager.reserve(requests))

    def copy(self, copies: list[tuple[int, int]]) -> None:
        """Execute (src, dst) block copies on every paged layer (shapes bucketed), with
        the window pages of copied blocks that have one."""
        if not copies:
            return
        window_copies = self.window_pages.copy(copies) if self.window_pages else []
        self._copy_pages(copies, codes=True)
        if window_copies:
            self._copy_pages(window_copies, codes=False)
        self.block_copies += len(copies)

    def _copy_pages(self, copies, codes: bool) -> None:
        """pool[dst] = pool[src] for the code pools (`codes`) or the window pools."""
        n = pow2(len(copies), minimum=8)
        src = np.zeros((n,), np.int32)
        dst = np.full((n,), -1, np.int32)
        src[:len(copies)], dst[:len(copies)] = zip(*copies)
        part = 0 if codes else 1
        moved = paged.copy_pool_blocks(
            tuple(paged.split_window_records(p)[part] for p in self.pools), src, dst)
        self.pools = tuple({**p, **m} for p, m in zip(self.pools, moved))

    def pass_tables(self, table: np.ndarray, start, n_new) -> dict:
        """The tables a forward pass installs: the block table, and for a windowed codec
        the window table of the rows' full-precision pages (research/kv/window_pages.py)."""
        tables = {paged.TABLE: table}
        if self.window_pages is not None:
            tables[paged.WINDOW_TABLE] = self.window_pages.pass_table(
                table, np.asarray(start), np.asarray(n_new))
        return tables

    def usable_prefix(self, blocks, n_cached: int) -> int:
        """How much of a prefix-cache hit of `n_cached` tokens a sequence can adopt: all
        of it, or for a windowed codec as far as its window pages still exist."""
        if self.window_pages is None:
            return n_cached
        return self.window_pages.usable_prefix(blocks, n_cached)

    def warm_copies(self, max_copies: int) -> None:
        """Compile the copy kernel for every bucket up to `max_copies` (no-op copies)."""
        n = 8
        while True:
            for codes in (True, False) if self.window_pages else (True,):
                self._copy_pages([(0, -1)] * n, codes)
            if n >= max_copies:
                break
            n *= 2
        jax.block_until_ready(self.pools)

    def table_width(self, n_blocks: int, minimum: int = 1) -> int:
        """Block-table width for a pass whose rows map at most `n_blocks` blocks: the
        power-of-two bucket (>= `minimum`), capped at `max_blocks`. Reads attend over
        width * block_size slots, so a pass costs what its live rows hold, not max_len."""
        return min(pow2(n_blocks, minimum=minimum), self.max_blocks)

    def table_widths(self, minimum: int = 1) -> list[int]:
        """Every width `table_width` can return (the shapes an engine compiles)."""
        widths, n = [], 1
        while True:
            w = self.table_width(n, minimum)
            if not widths or w != widths[-1]:
                widths.append(w)
            if w == self.max_blocks:
                return widths
            n = w + 1

    def block_table(self, seqs, rows: int, width: int | None = None) -> np.ndarray:
        """[rows, width] int32 table of `seqs` (padding rows and entries -1)."""
        width = self.max_blocks if width is None else width
        table = np.full((rows, width), -1, np.int32)
        if seqs:
            table[:len(seqs)] = self.manager.block_table(list(seqs))[:, :width]
        return table

    def cache_blocks(self, seq: int, tokens) -> None:
        """Name `seq`'s full computed blocks in the prefix cache (no-op without one)."""
        if self.prefix_cache is not None:
            self.prefix_cache.insert(tokens, self.manager.blocks(seq), self.manager.length(seq))


__all__ = ["PagedPool", "OutOfBlocksError", "pow2"]
