"""Public entry point: paged decode attention, "xla" (reference) or "pallas" (TPU/GPU)."""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels_pallas.paged_attention import kernel
from kernels_pallas.paged_attention.reference import paged_decode_attention_reference

IMPLEMENTATIONS = ("xla", "pallas")
BACKENDS = ("tpu", "triton")


def _validate(q, k_pool, v_pool, block_table, lengths) -> None:
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, q_heads, head_dim], got {q.shape=}")
    if k_pool.ndim != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool and v_pool must be equal [kv_heads, n_blocks, block_size, "
                         f"head_dim], got {k_pool.shape=} {v_pool.shape=}")
    b, hq, d = q.shape
    hkv = k_pool.shape[0]
    if k_pool.shape[3] != d:
        raise ValueError(f"head_dim mismatch: {q.shape=} vs {k_pool.shape=}")
    if hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hkv})")
    if block_table.ndim != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table must be [batch={b}, max_blocks], got "
                         f"{block_table.shape=}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [batch={b}], got {lengths.shape=}")
    if not jnp.issubdtype(block_table.dtype, jnp.integer) or \
            not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"block_table and lengths must be integers, got "
                        f"{block_table.dtype=} {lengths.dtype=}")


def paged_decode_attention(q: Float[Array, "B Hq D"], k_pool: Float[Array, "Hkv N S D"],
                           v_pool: Float[Array, "Hkv N S D"], block_table: Int[Array, "B M"],
                           lengths: Int[Array, "B"], *, window: int | None = None,
                           implementation: str = "xla", backend: str = "tpu",
                           interpret: bool = False,
                           block_sizes: kernel.BlockSizes = kernel.BlockSizes()) -> Array:
    """Attention of one query per row (at position lengths[b] - 1) over the row's first
    lengths[b] cached tokens, read through `block_table` (-1 = unmapped).

    implementation: "xla" = the plain-JAX reference; "pallas" = the kernel for `backend`
      ("tpu": Mosaic with scalar-prefetched block tables, "triton": GPU).
    interpret: run the Pallas kernel in interpret mode (CPU tests); explicit.
    A row with length 0 attends to nothing and returns zeros.
    """
    _validate(q, k_pool, v_pool, block_table, lengths)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    if implementation == "xla":
        return paged_decode_attention_reference(q, k_pool, v_pool, block_table, lengths,
                                                window)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    fn = (kernel.paged_decode_attention_tpu if backend == "tpu"
          else kernel.paged_decode_attention_gpu)
    return fn(q, k_pool, v_pool, block_table, lengths, window=window, interpret=interpret,
              block_sizes=block_sizes)
