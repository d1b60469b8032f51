"""Public entry point: paged decode attention over token-major pages.

    out = paged_decode_attention(q, k_pool, v_pool, block_table, lengths)  # "auto"
    out = paged_decode_attention(q, k8, v8, block_table, lengths,           # int8 pages
                                 k_scale=ks, v_scale=vs)

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


def validate_scales(k_pool, v_pool, k_scale, v_scale) -> None:
    """Float pages without scales, or int8 pages with [N, S, Hkv, 1] float scales."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale must be given together (int8 pages) or not "
                         "at all (float pages)")
    if k_scale is None:
        if not jnp.issubdtype(k_pool.dtype, jnp.floating) or k_pool.dtype != v_pool.dtype:
            raise TypeError(f"k_pool and v_pool without scales must be one float dtype, got "
                            f"{k_pool.dtype=} {v_pool.dtype=}")
        return
    if k_pool.dtype != jnp.int8 or v_pool.dtype != jnp.int8:
        raise TypeError(f"with scales, k_pool and v_pool must be int8, got {k_pool.dtype=} "
                        f"{v_pool.dtype=}")
    want = k_pool.shape[:3] + (1,)
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x.shape != want or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be float {want} (one scale per token and KV "
                             f"head), got {x.shape=} {x.dtype=}")


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
                           k_scale: Float[Array, "N S Hkv 1"] | None = None,
                           v_scale: Float[Array, "N S Hkv 1"] | None = None,
                           implementation: str = "auto", backend: str | None = None,
                           interpret: bool = False,
                           block_sizes: kernel.BlockSizes = kernel.BlockSizes()) -> Array:
    """Attention of one query per row (at position lengths[b] - 1) over the row's first
    lengths[b] cached tokens, read through `block_table` (-1 = unmapped, masked).

    k_scale, v_scale: the pools hold int8 codes (research.kv.quantized.Int8Codec's pages);
      token t of head h is pool[n, t, h] * scale[n, t, h]. The kernels dequantize one page
      tile at a time, so only codes and scales are read from memory.

    implementation: "auto" | "xla" | "pallas" (kernels_pallas.dispatch).
    backend: with "pallas" only: None = the platform's kernel, or force "mosaic_tpu" |
      "triton" (e.g. to interpret either on CPU).
    interpret: run the Pallas kernel in interpret mode (CPU tests); explicit.
    A row with length 0 attends to nothing and returns zeros.
    """
    validate(q, k_pool, v_pool, block_table, lengths)
    validate_scales(k_pool, v_pool, k_scale, v_scale)
    dispatch.check_implementation(implementation)
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")
    if backend is not None and implementation != "pallas":
        raise ValueError(f"backend={backend!r} applies to implementation='pallas' only, got "
                         f"implementation={implementation!r}")
    return _paged(q, k_pool, v_pool, block_table, lengths, k_scale, v_scale, window=window,
                  implementation=implementation, backend=backend, interpret=interpret,
                  block_sizes=block_sizes)


@functools.partial(jax.jit, static_argnames=("window", "implementation", "backend",
                                             "interpret", "block_sizes"))
def _paged(q, k_pool, v_pool, block_table, lengths, k_scale, v_scale, *, window,
           implementation, backend, interpret, block_sizes):
    kw = dict(window=window, interpret=interpret, block_sizes=block_sizes)

    def xla(*a):
        return paged_decode_attention_reference(*a[:5], window, *a[5:]).astype(q.dtype)
    tpu = functools.partial(kernel.paged_decode_attention_tpu, **kw)
    gpu = functools.partial(kernel.paged_decode_attention_gpu, **kw)
    args = (q, k_pool, v_pool, block_table, lengths, k_scale, v_scale)
    if backend is not None:
        return (tpu if backend == "mosaic_tpu" else gpu)(*args)
    if implementation == "auto" and not (
            interpret or kernel.gpu_supports(k_pool.shape[1], q.shape[2])):
        gpu = xla  # shapes the compiled Triton kernel cannot tile: XLA on CUDA too
    return dispatch.dispatch(*args, implementation=implementation, xla=xla, tpu=tpu,
                             cuda=gpu)
