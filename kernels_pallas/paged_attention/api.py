"""Public entry point: paged decode attention over token-major pages.

    out = paged_decode_attention(q, k_pool, v_pool, block_table, lengths)  # "auto"

implementation "auto" (default): the XLA reference on CPU, the Mosaic kernel on TPU, the
Triton kernel on CUDA, chosen when the program is lowered (kernels_pallas.dispatch).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels_pallas import dispatch
from kernels_pallas.paged_attention import kernel
from kernels_pallas.paged_attention.reference import paged_decode_attention_reference

IMPLEMENTATIONS = dispatch.IMPLEMENTATIONS
BACKENDS = ("mosaic_tpu", "triton")


def validate(q, k_pool, v_pool, block_table, lengths) -> None:
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, q_heads, head_dim], got {q.shape=}")
    if k_pool.ndim != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool and v_pool must be equal [n_blocks, block_size, kv_heads, "
                         f"head_dim], got {k_pool.shape=} {v_pool.shape=}")
    b, hq, d = q.shape
    hkv = k_pool.shape[2]
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


def paged_decode_attention(q: Float[Array, "B Hq D"], k_pool: Float[Array, "N S Hkv D"],
                           v_pool: Float[Array, "N S Hkv D"], block_table: Int[Array, "B M"],
                           lengths: Int[Array, "B"], *, window: int | None = None,
                           implementation: str = "auto", backend: str | None = None,
                           interpret: bool = False,
                           block_sizes: kernel.BlockSizes = kernel.BlockSizes()) -> Array:
    """Attention of one query per row (at position lengths[b] - 1) over the row's first
    lengths[b] cached tokens, read through `block_table` (-1 = unmapped, masked).

    implementation: "auto" | "xla" | "pallas" (kernels_pallas.dispatch).
    backend: with "pallas" only: None = the platform's kernel, or force "mosaic_tpu" |
      "triton" (e.g. to interpret either on CPU).
    interpret: run the Pallas kernel in interpret mode (CPU tests); explicit.
    A row with length 0 attends to nothing and returns zeros.
    """
    validate(q, k_pool, v_pool, block_table, lengths)
    dispatch.check_implementation(implementation)
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")
    if backend is not None and implementation != "pallas":
        raise ValueError(f"backend={backend!r} applies to implementation='pallas' only, got "
                         f"implementation={implementation!r}")
    return _paged(q, k_pool, v_pool, block_table, lengths, window=window,
                  implementation=implementation, backend=backend, interpret=interpret,
                  block_sizes=block_sizes)


@functools.partial(jax.jit, static_argnames=("window", "implementation", "backend",
                                             "interpret", "block_sizes"))
def _paged(q, k_pool, v_pool, block_table, lengths, *, window, implementation, backend,
           interpret, block_sizes):
    kw = dict(window=window, interpret=interpret, block_sizes=block_sizes)
    xla = functools.partial(paged_decode_attention_reference, window=window)
    tpu = functools.partial(kernel.paged_decode_attention_tpu, **kw)
    gpu = functools.partial(kernel.paged_decode_attention_gpu, **kw)
    args = (q, k_pool, v_pool, block_table, lengths)
    if backend is not None:
        return (tpu if backend == "mosaic_tpu" else gpu)(*args)
    if implementation == "auto" and not (
            interpret or kernel.gpu_supports(k_pool.shape[1], q.shape[2])):
        gpu = xla  # shapes the compiled Triton kernel cannot tile: XLA on CUDA too
    return dispatch.dispatch(*args, implementation=implementation, xla=xla, tpu=tpu,
                             cuda=gpu)
