"""Paged (block) KV layout: a global pool of fixed-size blocks read through block tables.

Per layer the state is

    {"k": [Hkv, n_blocks, block_size, D], "v": same, "block_table": [B, M] int32}

Row b's token at absolute position p lives in block `block_table[b, p // block_size]`,
slot `p % block_size`; entry -1 means "no block mapped". Several rows may map the same
block (a shared prefix): that is how N candidate paths of a search hold one copy of
their prompt. Which block belongs to whom is decided on the host by
`research.kv.block_allocator.BlockManager` (reference counts, copy-on-write); the device
side only scatters new tokens through the table and attends through it.

`init` maps row b to blocks [b*M, (b+1)*M) when the pool is large enough, so the cache is
a drop-in for the unmodified `generate()` (no sharing then). A search engine builds a
smaller pool with `n_blocks`, and installs its own tables with `with_block_tables`
before every forward pass. The pool layout [Hkv, n_blocks, block_size, D] keeps a block's
(block_size, D) tile contiguous, which is what the Pallas decode kernel streams.

Writes through an unmapped (-1) entry are dropped; the host manager guarantees that every
position a forward pass writes is mapped (`BlockManager.reserve` before the call).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kernels_pallas.paged_attention.api import paged_decode_attention
from kernels_pallas.paged_attention.reference import paged_attention_reference
from flax import struct
from research.transforms import Transform
from research.kv.base import KVCache

IMPLEMENTATIONS = ("xla", "pallas")


@struct.dataclass
class PagedKVCache(KVCache):
    """Block-table KV cache. `n_blocks=0` sizes the pool for `batch` unshared rows.

    implementation: "xla" gathers each row's blocks and runs the core masked attention
      (the reference); "pallas" runs `kernels_pallas.paged_attention` for single-token
      decode chunks (T == 1) and the reference otherwise.
    backend: the Pallas kernel's target, "tpu" (Mosaic) or "triton" (GPU).
    interpret: run the Pallas kernel in interpret mode (CPU); explicit, never guessed.
    """

    block_size: int = struct.field(pytree_node=False, default=16)
    n_blocks: int = struct.field(pytree_node=False, default=0)
    dtype: str = struct.field(pytree_node=False, default="float32")
    implementation: str = struct.field(pytree_node=False, default="xla")
    backend: str = struct.field(pytree_node=False, default="tpu")
    interpret: bool = struct.field(pytree_node=False, default=False)

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.n_blocks < 0:
            raise ValueError(f"n_blocks must be >= 0 (0 = one private region per row), "
                             f"got {self.n_blocks}")
        if jnp.dtype(self.dtype) not in (jnp.float32, jnp.bfloat16, jnp.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.backend not in ("tpu", "triton"):
            raise ValueError(f"backend must be 'tpu' or 'triton', got {self.backend!r}")
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, "
                             f"got {self.implementation!r}")

    def blocks_per_seq(self, max_len: int) -> int:
        return -(-max_len // self.block_size)

    def init(self, batch, max_len, n_kv_heads, head_dim):
        m = self.blocks_per_seq(max_len)
        n_blocks = self.n_blocks or batch * m
        pool = (n_kv_heads, n_blocks, self.block_size, head_dim)
        return {"k": jnp.zeros(pool, self.dtype), "v": jnp.zeros(pool, self.dtype),
                "block_table": default_block_table(batch, m, n_blocks)}

    def update_and_attend(self, state, q, k, v, *, start, n_new, window):
        t = q.shape[1]
        table = state["block_table"]
        if table.shape[0] != q.shape[0]:
            raise ValueError(f"block_table has {table.shape[0]} rows but the chunk has "
                             f"batch {q.shape[0]}; install tables with with_block_tables")
        state = dict(state, k=write_tokens(state["k"], table, k, start, n_new),
                     v=write_tokens(state["v"], table, v, start, n_new))
        lengths = start + n_new
        if self.implementation == "pallas" and t == 1:
            out = paged_decode_attention(
                q[:, 0], state["k"], state["v"], table, lengths, window=window,
                implementation="pallas", backend=self.backend, interpret=self.interpret)
            return out[:, None], state
        q_pos = start[:, None] + jnp.arange(t)[None, :]
        return paged_attention_reference(q, state["k"], state["v"], table, q_pos,
                                         lengths, window), state

    def capacity(self, max_len):
        return self.blocks_per_seq(max_len) * self.block_size

    def describe(self):
        impl = "" if self.implementation == "xla" else f",{self.implementation}"
        return f"paged{self.block_size}[{jnp.dtype(self.dtype).name}{impl}]"


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


def write_tokens(pool: Float[Array, "Hkv N S D"], table: Int[Array, "B M"],
                 x: Float[Array, "B T Hkv D"], start: Int[Array, "B"],
                 n_new: Int[Array, "B"]) -> Array:
    """pool[:, block, slot] = x for the first n_new[b] tokens of each row."""
    t = x.shape[1]
    positions = start[:, None] + jnp.arange(t)[None, :]
    valid = jnp.arange(t)[None, :] < n_new[:, None]
    block, slot = token_slots(table, positions, valid, pool.shape[1], pool.shape[2])
    values = jnp.transpose(x, (2, 0, 1, 3)).astype(pool.dtype)  # [Hkv, B, T, D]
    return pool.at[:, block, slot].set(values, mode="drop")


# -- whole-model helpers ---------------------------------------------------------------
def with_block_tables(states: tuple, table: Int[Array, "B M"]) -> tuple:
    """The same block table installed in every paged layer's state."""
    table = jnp.asarray(table, jnp.int32)
    return tuple(dict(s, block_table=table) if "block_table" in s else s for s in states)


def copy_blocks(states: tuple, src: Int[Array, "C"], dst: Int[Array, "C"]) -> tuple:
    """pool[:, dst[i]] = pool[:, src[i]] in every paged layer (copy-on-write); dst<0 skipped.

    The pools are donated (updated in place); block tables are passed through.
    """
    paged_layers = [i for i, s in enumerate(states) if "block_table" in s]
    pools = tuple((states[i]["k"], states[i]["v"]) for i in paged_layers)
    pools = _copy_pool_blocks(pools, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32))
    out = list(states)
    for i, (k, v) in zip(paged_layers, pools):
        out[i] = dict(states[i], k=k, v=v)
    return tuple(out)


@functools.partial(jax.jit, donate_argnums=0)
def _copy_pool_blocks(pools, src, dst):
    def copy(pool):
        dst_ok = jnp.where(dst >= 0, dst, pool.shape[1])
        return pool.at[:, dst_ok].set(pool[:, jnp.maximum(src, 0)], mode="drop")
    return jax.tree.map(copy, pools)


def paged_kv_cache(block_size: int = 16, n_blocks: int = 0, implementation: str = "xla",
                   interpret: bool = False, backend: str = "tpu") -> Transform:
    """Transform: every layer's cache becomes a `PagedKVCache` keeping the layer's dtype."""
    def calibrate(model, data):
        del model, data
        return None

    def apply(model, state):
        del state
        caches = tuple(PagedKVCache(block_size=block_size, n_blocks=n_blocks,
                                    dtype=getattr(c, "dtype", "float32"),
                                    implementation=implementation, backend=backend,
                                    interpret=interpret)
                       for c in model.caches)
        return model.replace(caches=caches)

    PagedKVCache(block_size=block_size, n_blocks=n_blocks, implementation=implementation,
                 backend=backend)  # validates the arguments now, not at apply time
    return Transform(calibrate, apply, f"paged_kv(block_size={block_size})")
