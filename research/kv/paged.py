"""Paged (block) layout: a global pool of fixed-size blocks read through block tables.

Per layer the state is the codec's records in pages plus the table:

    {<record>: [n_blocks, block_size, *record], ..., "block_table": [B, M] int32}

(for the float codec: "k", "v": [n_blocks, block_size, Hkv, D]). Row b's token at
absolute position p lives in block `block_table[b, p // block_size]`, slot
`p % block_size`; entry -1 means "no block mapped". Several rows may map the same block
(a shared prefix): that is how N candidate paths of a search hold one copy of their
prompt, whatever the codec (bf16 values, int8, VQ codes). Which block belongs to whom is
decided on the host by `research.kv.block_allocator.BlockManager` (reference counts,
copy-on-write); the device side only scatters new records through the table and attends
through it.

`init` maps row b to blocks [b*M, (b+1)*M) when the pool is large enough, so the cache is
a drop-in for the unmodified `generate()` (no sharing then). A search engine builds a
smaller pool with `n_blocks`, and installs its own tables with `with_block_tables`
before every forward pass. Pools are token-major: a page holds all KV heads of its
tokens, which is what the decode kernels stream.

Writes through an unmapped (-1) entry are dropped; the host manager guarantees that every
position a forward pass writes is mapped (`BlockManager.reserve` before the call).

A codec with per-sequence state (KIVI's full-precision residual ring) keeps it per row
under "seq", beside the pages: its codes live in pages like any codec's, but the rows must
then stay bound to their sequences (a fork copies the row: `copy_seq_rows`). The
PagedEngine, which re-binds rows every pass, refuses such codecs by name.

A windowed codec (research/kv/windowed.py: bfloat16 sink + recent tokens over a low-bit
codec) keeps its codes in the pool like any codec and its bfloat16 copies ("k_hi", "v_hi")
in a second pool of `window_blocks` blocks, mapped per row by "window_table": block j of a
row's table has a window page only while the row may read it in full precision (its first
S tokens, its last W). The host (`research.decode.paged_pool.PagedPool`) decides which; a
chunk's own tokens are read from the chunk itself, so only the tokens written before it
and still inside the window need a window page. Without a window pool
(`window_blocks=0`, `generate` and hand-managed tables) every block's pages hold its
copies too, so block tables, forks and block copies need nothing more.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Int

from kernels_pallas.dispatch import IMPLEMENTATIONS
from kernels_pallas.paged_attention.api import BACKENDS
from research.transforms import Transform, stateless
from research.kv.base import KVCache, check_codec, lookback_positions, poison_rows
from research.kv.codec import (SEQ, FloatCodec, KVCodec, KVView, PageRead,
                               decode_through_reader)
from research.kv.dense import DenseKVCache, either_bad
from research.kv.window import WindowKVCache
from research.kv.windowed import HI_RECORDS, is_windowed, window_positions

TABLE = "block_table"
# a windowed codec's bfloat16 copies (research/kv/windowed.py) live in their own smaller
# pool of `window_blocks` blocks, read through this second table (-1: no window page)
WINDOW_TABLE = "window_table"


@struct.dataclass
class PagedKVCache(KVCache):
    """Block-table layout over any codec. `n_blocks=0` sizes the pool for `batch` rows.

    implementation: single-token decode steps of a codec with a page reader (float, int8,
      TaSQ/CQ codes: `KVCodec.page_reader`) go through its paged Pallas kernel with this
      choice: "auto" (default: XLA on CPU, the kernel on TPU and GPU, chosen at lowering),
      "xla" or "pallas"; the kernel reads live pages through the block table, no row is
      gathered. Other codecs (KIVI), windows of VQ codecs and prefill chunks gather each
      row's live pages and let the codec attend.
    backend: with "pallas" only, force the kernel: None (the platform's), "mosaic_tpu"
      or "triton".
    interpret: run the Pallas kernel in interpret mode (CPU); explicit, never guessed.
    """

    codec: KVCodec = FloatCodec()
    block_size: int = struct.field(pytree_node=False, default=16)
    n_blocks: int = struct.field(pytree_node=False, default=0)
    implementation: str = struct.field(pytree_node=False, default="auto")
    backend: str | None = struct.field(pytree_node=False, default=None)
    interpret: bool = struct.field(pytree_node=False, default=False)
    # a windowed codec's window pool, read through "window_table" (0: none; each block's
    # bf16 copies then sit in its own pages, and the block table maps them)
    window_blocks: int = struct.field(pytree_node=False, default=0)

    def __post_init__(self):
        check_codec(self.codec)
        if self.window_blocks < 0:
            raise ValueError(f"window_blocks must be >= 0, got {self.window_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.n_blocks < 0:
            raise ValueError(f"n_blocks must be >= 0 (0 = one private region per row), "
                             f"got {self.n_blocks}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"backend must be None or one of {BACKENDS}, got "
                             f"{self.backend!r}")
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, "
                             f"got {self.implementation!r}")
        if self.block_size % self.codec.align:
            raise ValueError(f"block_size ({self.block_size}) must be a multiple of the "
                             f"codec's align ({self.codec.align}, {self.codec.describe()})")

    def blocks_per_seq(self, max_len: int) -> int:
        return -(-max_len // self.block_size)

    def init(self, batch, max_len, n_kv_heads, head_dim):
        m = self.blocks_per_seq(max_len)
        n_blocks = self.n_blocks or batch * m
        spec = self.codec.record_spec(n_kv_heads, head_dim)
        state = {}
        if is_windowed(self.codec) and self.window_blocks:  # bf16 copies in their own pool
            codes, copies = split_window_records(spec)
            state.update(empty_pages(codes, n_blocks, self.block_size))
            state.update(empty_pages(copies, self.window_blocks, self.block_size))
            state[WINDOW_TABLE] = default_block_table(batch, m, self.window_blocks)
        else:
            state.update(empty_pages(spec, n_blocks, self.block_size))
        state[TABLE] = default_block_table(batch, m, n_blocks)
        seq = self.codec.init_seq_state(batch, n_kv_heads, head_dim)
        return state if seq is None else {**state, SEQ: seq}

    def update_and_attend(self, state, q, k, v, *, start, n_new, window):
        b, t = q.shape[:2]
        table = state[TABLE]
        if table.shape[0] != b:
            raise ValueError(f"block_table has {table.shape[0]} rows but the chunk has "
                             f"batch {b}; install tables with with_block_tables")
        q_pos = start[:, None] + jnp.arange(t)[None, :]
        dtypes = {name: spec.dtype
                  for name, spec in self.codec.record_spec(k.shape[2], k.shape[3]).items()}
        windowed = is_windowed(self.codec)
        pools = pools_of(state)
        # without a window pool, a block's bf16 copies sit in the block's own pages
        window_table = state[WINDOW_TABLE] if windowed and self.window_blocks else table
        earlier = None
        if self.codec.lookback:  # in the chunk's first block (block_size % align == 0)
            before = lookback_positions(start, self.codec.lookback)
            if windowed:
                lo, hi = split_window_records(pools)
                earlier = {**gather_positions(lo, table, before, dtypes),
                           **gather_positions(hi, window_table, before, dtypes)}
            else:
                earlier = gather_positions(pools, table, before, dtypes)
        w = self.codec.write(k, v, q_pos, jnp.arange(t)[None, :] < n_new[:, None],
                             state.get(SEQ), earlier)
        if windowed:  # codes through the block table, bf16 copies through the window table
            (lo, hi), (lo_new, hi_new) = (split_window_records(pools),
                                          split_window_records(w.records))
            pools = {**write_records(lo, table, lo_new, w.positions, w.valid, dtypes),
                     **write_records(hi, window_table, hi_new, w.positions, w.valid, dtypes)}
        else:
            pools = write_records(pools, table, w.records, w.positions, w.valid, dtypes)
        lengths = start + n_new

        def gathered(q, pools, table, lengths):
            if windowed:
                view = gather_window_view(pools, table, window_table, q_pos, lengths,
                                          window, dtypes, w)
                # a decode step reads only the S + W window tokens (when the codec takes
                # that path, XLA drops the whole-context copies gathered above)
                if q.shape[1] == 1:
                    extra = dict(w.extra or {}, window=gather_window_set(
                        pools, window_table, lengths, self.codec.sink, self.codec.recent,
                        dtypes))
                    return self.codec.attend(q, view._replace(extra=extra))
            else:
                view = gather_view(pools, table, q_pos, lengths, window, dtypes)
            return self.codec.attend(q, view._replace(extra=w.extra))

        reader = (self.codec.page_reader(window, PageRead(self.implementation, self.backend,
                                                          self.interpret))
                  if self.implementation != "xla" and t == 1 else None)
        if reader is not None:
            def read_stored(q, pools, table, lengths):
                pages = {name: as_logical(pool, dtypes[name]) for name, pool in pools.items()}
                return reader(q, pages, table, lengths)
            # on CPU "auto" reads gathered pages (a kernel's XLA path would view the whole
            # 16-bit pool as floats first: a copy there, see `as_stored`)
            out = decode_through_reader(read_stored, self.implementation, q, pools, table,
                                        lengths, gathered)
        else:
            out = gathered(q, pools, table, lengths)
        out = poison_rows(out, either_bad(self.codec.check_finite(k, v), w.bad_rows))
        new = {**pools, TABLE: table}
        if WINDOW_TABLE in state:
            new[WINDOW_TABLE] = state[WINDOW_TABLE]
        if w.seq_state is not None:
            new[SEQ] = w.seq_state
        return out.astype(q.dtype), new

    def capacity(self, max_len):
        return self.blocks_per_seq(max_len) * self.block_size

    def describe(self):
        impl = "" if self.implementation == "auto" else f",{self.implementation}"
        return f"paged{self.block_size}[{self.codec.describe()}{impl}]"


def pools_of(state: dict) -> dict:
    """The record pools of a paged layer state (no block tables, no per-row state)."""
    return {name: x for name, x in state.items() if name not in (TABLE, WINDOW_TABLE, SEQ)}


def empty_pages(spec: dict, n_blocks: int, block_size: int) -> dict:
    """Zero pages [n_blocks, block_size, *record] of each record of `spec`, as stored."""
    return {name: as_stored(jnp.zeros((n_blocks, block_size) + r.shape, r.dtype))
            for name, r in spec.items()}


def split_window_records(records: dict) -> tuple[dict, dict]:
    """(codes, bfloat16 window copies) of a windowed codec's records or pools."""
    return ({n: x for n, x in records.items() if n not in HI_RECORDS},
            {n: x for n, x in records.items() if n in HI_RECORDS})


def gather_window_view(pools: dict, table, window_table, q_pos, lengths, window, dtypes,
                       written) -> KVView:
    """A windowed codec's view: codes through the block table, bfloat16 copies through the
    window table, with the chunk's own copies laid over their positions. An unmapped
    window page reads page 0 and is never chosen: the host maps every page a query reads
    in full precision (research/kv/window_pages.py raises before a pass that would not)."""
    lo, hi = split_window_records(pools)
    view = gather_view(lo, table, q_pos, lengths, window, dtypes)
    hi_view = gather_view(hi, window_table, q_pos, lengths, window, dtypes).records
    b, n_slots = window_table.shape[0], window_table.shape[1] * next(
        iter(hi.values())).shape[1]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], written.positions.shape)
    slots = jnp.where(written.valid, written.positions, n_slots)
    fresh = {name: hi_view[name].at[rows, slots].set(
                 written.records[name].astype(hi_view[name].dtype), mode="drop")
             for name in hi_view}
    return view._replace(records={**view.records, **fresh})


def gather_window_set(pools: dict, window_table, lengths, sink: int, recent: int,
                      dtypes: dict):
    """(positions, valid, K, V) of each row's first `sink` and last `recent` tokens from
    the window pages (research/kv/windowed.py `WindowedCodec._window_set`)."""
    pos, valid = window_positions(lengths, sink, recent)
    hi = {name: pools[name] for name in HI_RECORDS}
    copies, mapped = gather_positions(hi, window_table, pos, dtypes, with_mapped=True)
    return pos, valid & mapped, copies["k_hi"], copies["v_hi"]


def gather_positions(pools: dict, table, positions, dtypes: dict, with_mapped=False):
    """The records {name: [B, L, *record]} at `positions` [B, L] of each row, read through
    `table` (an unmapped or out-of-range position reads some page: callers mask it); with
    `with_mapped`, also whether each position's block is mapped."""
    block_size = next(iter(pools.values())).shape[1]
    col = jnp.clip(positions // block_size, 0, table.shape[1] - 1)
    page = jnp.take_along_axis(table, col, axis=1)
    slot = jnp.clip(positions, 0) % block_size
    out = {name: as_logical(pool[jnp.maximum(page, 0), slot], dtypes[name])
           for name, pool in pools.items()}
    return (out, page >= 0) if with_mapped else out


def has_seq_state(state: dict) -> bool:
    """Whether a layer state holds a codec's per-sequence (per-row) state."""
    return SEQ in state


def default_block_table(batch: int, blocks_per_seq: int, n_blocks: int) -> Array:
    """Row b -> blocks [b*M, (b+1)*M) where the pool has them, -1 past its end."""
    ids = np.arange(batch * blocks_per_seq, dtype=np.int32).reshape(batch, blocks_per_seq)
    return jnp.asarray(np.where(ids < n_blocks, ids, -1))


def token_slots(table: Int[Array, "B M"], positions: Int[Array, "B T"],
                valid: Array, n_blocks: int, block_size: int):
    """(block id, slot) per token; invalid or unmapped tokens get block id n_blocks."""
    m = table.shape[1]
    page = positions // block_size
    block = jnp.take_along_axis(table, jnp.clip(page, 0, m - 1), axis=1)
    ok = valid & (page < m) & (block >= 0)
    return jnp.where(ok, block, n_blocks), positions % block_size


def write_records(pools: dict, table: Int[Array, "B M"], records: dict,
                  positions: Int[Array, "B T"], valid: Array, dtypes: dict) -> dict:
    """pool[block, slot] = record for every valid token (others dropped); `dtypes`: the
    codec's record dtypes (pools hold them as `as_stored`)."""
    n_blocks, block_size = next(iter(pools.values())).shape[:2]
    block, slot = token_slots(table, positions, valid, n_blocks, block_size)
    return {name: pool.at[block, slot].set(as_stored(records[name].astype(dtypes[name])),
                                           mode="drop") for name, pool in pools.items()}


def as_stored(x: Array) -> Array:
    """How a page pool of `x`'s dtype is stored: 16-bit floats by their uint16 bits.

    XLA:CPU has no bf16/f16 scatter or in-place update: it converts the whole operand to
    f32 and back, a copy of the entire pool per layer per step (the engine's bf16 decode
    step grew linearly with n_blocks; uint16 updates stay in place, see
    results/serving_overhead_small). Pages are therefore stored as bits and viewed as
    floats after they are gathered (`as_logical`): same bytes, same values. The Pallas
    kernels (TPU/GPU) get the whole pool viewed as floats, a same-width bitcast (expected
    to be free there; not yet timed on hardware)."""
    if x.dtype.itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x


def as_logical(x: Array, dtype) -> Array:
    """Stored pages (or records gathered from them) as the codec's `dtype` again."""
    dtype = jnp.dtype(dtype)
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def gather_view(pools: dict, table: Int[Array, "B M"], q_pos: Int[Array, "B T"],
                lengths: Int[Array, "B"], window: int | None, dtypes: dict) -> KVView:
    """Each row's pages in position order, as a positional view of M * block_size slots
    (records of the codec's `dtypes`)."""
    b, m = table.shape
    block_size = next(iter(pools.values())).shape[1]
    pages = jnp.maximum(table, 0)  # unmapped pages lie past `lengths`: masked below
    records = {name: as_logical(pool[pages], dtypes[name]).reshape(
                   (b, m * block_size) + pool.shape[2:]) for name, pool in pools.items()}
    kv_pos = jnp.broadcast_to(jnp.arange(m * block_size)[None, :], (b, m * block_size))
    return KVView(records, q_pos, kv_pos, kv_pos < lengths[:, None], window,
                  positional=True, lengths=lengths)


# -- whole-model helpers ---------------------------------------------------------------
def with_block_tables(states: tuple, table: Int[Array, "B M"]) -> tuple:
    """The same block table installed in every paged layer's state."""
    table = jnp.asarray(table, jnp.int32)
    return tuple(dict(s, block_table=table) if TABLE in s else s for s in states)


def copy_blocks(states: tuple, src: Int[Array, "C"], dst: Int[Array, "C"]) -> tuple:
    """pool[dst[i]] = pool[src[i]] for every record of every paged layer (copy-on-write);
    dst < 0 is skipped. The pools are donated (updated in place); tables pass through."""
    paged_layers = [i for i, s in enumerate(states) if TABLE in s]
    pools = tuple(pools_of(states[i]) for i in paged_layers)
    pools = copy_pool_blocks(pools, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32))
    out = list(states)
    for i, p in zip(paged_layers, pools):
        out[i] = {**states[i], **p}
    return tuple(out)


def copy_seq_rows(states: tuple, src: int, dst: int) -> tuple:
    """Row dst of every layer's per-sequence codec state := row src (a fork's share of
    what does not live in pages; the pages themselves are shared copy-on-write)."""
    def copy(x):
        return x.at[dst].set(x[src])
    return tuple({**s, SEQ: jax.tree.map(copy, s[SEQ])} if SEQ in s else s for s in states)


@functools.partial(jax.jit, donate_argnums=0)
def copy_pool_blocks(pools, src: Int[Array, "C"], dst: Int[Array, "C"]):
    """Every array of the pytree `pools` ([n_blocks, ...] each): pool[dst] = pool[src]."""
    def copy(pool):
        dst_ok = jnp.where(dst >= 0, dst, pool.shape[0])
        return pool.at[dst_ok].set(pool[jnp.maximum(src, 0)], mode="drop")
    return jax.tree.map(copy, pools)


def paged_kv_cache(block_size: int = 16, n_blocks: int = 0, implementation: str = "auto",
                   interpret: bool = False, backend: str | None = None,
                   window_blocks: int = 0) -> Transform:
    """Transform: every layer's records move into pages, each layer keeping its codec.

    Dense and window layers keep their codec (a window layer's pages hold the whole
    context; attention still masks to the window). A cache that is not a codec over a
    layout (an eviction press) cannot be paged: refused, naming it.
    """
    def apply(model, state):
        del state
        caches = []
        for i, cache in enumerate(model.caches):
            if not isinstance(cache, (DenseKVCache, WindowKVCache, PagedKVCache)):
                raise TypeError(
                    f"paged_kv_cache would discard layer {i}'s {cache.describe()} cache: "
                    "only codec caches in a dense, window or paged layout can be paged")
            caches.append(PagedKVCache(cache.codec, block_size=block_size, n_blocks=n_blocks,
                                       implementation=implementation, backend=backend,
                                       interpret=interpret, window_blocks=window_blocks))
        return model.replace(caches=tuple(caches))

    PagedKVCache(block_size=block_size, n_blocks=n_blocks, implementation=implementation,
                 backend=backend, window_blocks=window_blocks)  # validates the arguments now
    return stateless(apply, f"paged_kv(block_size={block_size})")
