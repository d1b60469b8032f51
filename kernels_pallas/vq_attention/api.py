"""Public entry points: decode attention over VQ codes, dense [B, S, Hkv, G] or paged.

    out = vq_decode_attention(q, k_codes, v_codes, k_codebook, v_codebook, lengths)
    out = vq_decode_attention_paged_codes(q, k_pages, v_pages, k_codebook, v_codebook,
                                          block_table, lengths)   # pages, no row gather

implementation "auto" (default): the XLA reference on CPU, the Mosaic one-hot kernel on
TPU, the Triton gather kernel on CUDA, chosen when the program is lowered
(kernels_pallas.dispatch); "xla"; "pallas" (the platform's kernel, or `backend`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt8

from kernels_pallas import dispatch
from kernels_pallas.paged_attention.kernel import BlockSizes as PagedBlockSizes
from kernels_pallas.vq_attention import paged
from kernels_pallas.vq_attention.kernel import (BACKENDS, BlockSizes, gpu_supports,
                                                vq_decode_attention_pallas)
from kernels_pallas.vq_attention.reference import (vq_decode_attention_paged,
                                                   vq_decode_attention_reference)
from kernels_pallas.vq_attention.rope import KeyRope

IMPLEMENTATIONS = dispatch.IMPLEMENTATIONS


def validate_codes_and_codebooks(k_codes, v_codes, k_codebook, v_codebook,
                                 n_kv_heads: int | None = None,
                                 head_dim: int | None = None) -> None:
    """Shapes/dtypes of token-major codes [B, S, Hkv, G] (or pages [N, P, Hkv, G]) uint8 and
    codebooks [Hc, G, K, g] float."""
    for name, c in (("k_codes", k_codes), ("v_codes", v_codes)):
        if c.ndim != 4 or c.dtype != jnp.uint8:
            raise TypeError(f"{name} must be uint8 [B, S, Hkv, G], got {c.shape=} {c.dtype=}")
    if k_codes.shape != v_codes.shape:
        raise ValueError(f"k_codes and v_codes must match, got {k_codes.shape=} "
                         f"{v_codes.shape=}")
    _, _, hkv, g = k_codes.shape
    for name, cb in (("k_codebook", k_codebook), ("v_codebook", v_codebook)):
        if cb.ndim != 4 or not jnp.issubdtype(cb.dtype, jnp.floating):
            raise TypeError(f"{name} must be a float [Hc, G, K, g] array, got "
                            f"{cb.shape=} {cb.dtype=}")
        if cb.shape[0] not in (1, hkv) or cb.shape[1] != g:
            raise ValueError(f"{name} must be [1 or Hkv={hkv}, G={g}, K, g], got {cb.shape=}")
        if cb.shape[2] > 256:
            raise ValueError(f"{name} has {cb.shape[2]} centroids; uint8 codes address <= 256")
        if head_dim is not None and cb.shape[1] * cb.shape[3] != head_dim:
            raise ValueError(f"{name} groups x group size = {cb.shape[1]}x{cb.shape[3]} "
                             f"must equal head_dim={head_dim}")
    if n_kv_heads is not None and hkv != n_kv_heads:
        raise ValueError(f"codes have {hkv} KV heads, expected {n_kv_heads}")


def validate_key_rope(key_rope, n_kv_heads: int, head_dim: int) -> None:
    if not isinstance(key_rope, KeyRope):
        raise TypeError(f"key_rope must be a KeyRope, got {type(key_rope).__name__}")
    for name in ("omega", "partner", "sign"):
        x = getattr(key_rope, name)
        if x.ndim != 2 or x.shape[0] not in (1, n_kv_heads) or x.shape[1] != head_dim:
            raise ValueError(f"key_rope.{name} must be [1 or Hkv={n_kv_heads}, "
                             f"D={head_dim}], got {x.shape}")


def _validate_query(q, k_codes, v_codes, k_codebook, v_codebook, lengths, key_rope,
                    batch: int) -> None:
    if q.ndim != 3:
        raise ValueError(f"q must be [B, Hq, D], got {q.shape=}")
    validate_codes_and_codebooks(k_codes, v_codes, k_codebook, v_codebook,
                                 head_dim=q.shape[-1])
    b, hq, _ = q.shape
    if batch != b or hq % k_codes.shape[2]:
        raise ValueError(f"q {q.shape=} does not fit codes {k_codes.shape=} (batch must "
                         "match and Hq must be a multiple of Hkv)")
    if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths must be integer [B={b}], got {lengths.shape=} "
                         f"{lengths.dtype=}")
    if key_rope is not None:
        validate_key_rope(key_rope, k_codes.shape[2], q.shape[-1])


def _check_choice(implementation: str, backend: str | None) -> None:
    dispatch.check_implementation(implementation)
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")
    if backend is not None and implementation != "pallas":
        raise ValueError(f"backend={backend!r} applies to implementation='pallas' only, got "
                         f"implementation={implementation!r}")


def vq_decode_attention(q: Float[Array, "B Hq D"], k_codes: UInt8[Array, "B S Hkv G"],
                        v_codes: UInt8[Array, "B S Hkv G"], k_codebook: Float[Array, "Hc G K g"],
                        v_codebook: Float[Array, "Hc G K g"], lengths: Int[Array, "B"], *,
                        implementation: str = "auto", interpret: bool = False,
                        block_sizes: BlockSizes | None = None, backend: str | None = None,
                        sm_scale: float | None = None,
                        key_rope: KeyRope | None = None) -> Float[Array, "B Hq D"]:
    """Attention of one query token per row over the first `lengths[b]` coded tokens.

    implementation: "auto" | "xla" | "pallas" (module docstring). backend: with "pallas"
      only: None = the platform's kernel, or force "triton" | "mosaic_tpu" (e.g. to
      interpret either body on CPU). interpret: run the kernel in the Pallas interpreter.
    block_sizes: None = the backend's defaults (kernel.DEFAULT_BLOCKS).
    key_rope: the keys were coded before RoPE, in the codec channel order these tables
      describe (`KeyRope.from_permutation`); cache slot s holds position s.
    """
    _check_choice(implementation, backend)
    _validate_query(q, k_codes, v_codes, k_codebook, v_codebook, lengths, key_rope,
                    k_codes.shape[0])
    return _vq_decode(q, k_codes, v_codes, k_codebook, v_codebook, lengths, key_rope,
                      implementation=implementation, interpret=interpret,
                      block_sizes=block_sizes, backend=backend, sm_scale=sm_scale)


@functools.partial(jax.jit, static_argnames=("implementation", "interpret", "block_sizes",
                                             "backend", "sm_scale"))
def _vq_decode(q, k_codes, v_codes, k_codebook, v_codebook, lengths, key_rope, *,
               implementation, interpret, block_sizes, backend, sm_scale):
    def xla(*a):
        return vq_decode_attention_reference(*a[:6], sm_scale=sm_scale,
                                             key_rope=a[6]).astype(q.dtype)

    def kernel(kind):
        return lambda *a: vq_decode_attention_pallas(
            *a, block_sizes=block_sizes, interpret=interpret, backend=kind,
            sm_scale=sm_scale)

    args = (q, k_codes, v_codes, k_codebook, v_codebook, lengths, key_rope)
    if backend is not None:
        return kernel(backend)(*args)
    cuda = kernel("triton")
    if implementation == "auto" and not (interpret or gpu_supports(
            k_codes.shape[3], v_codebook.shape[3], q.shape[2])):
        cuda = xla  # shapes the compiled Triton kernel cannot tile: XLA on CUDA too
    return dispatch.dispatch(*args, implementation=implementation, xla=xla,
                             tpu=kernel("mosaic_tpu"), cuda=cuda)


def vq_decode_attention_paged_codes(q: Float[Array, "B Hq D"],
                                    k_pages: UInt8[Array, "N P Hkv G"],
                                    v_pages: UInt8[Array, "N P Hkv G"],
                                    k_codebook: Float[Array, "Hc G K g"],
                                    v_codebook: Float[Array, "Hc G K g"],
                                    block_table: Int[Array, "B M"], lengths: Int[Array, "B"],
                                    *, sm_scale: float | None = None,
                                    key_rope: KeyRope | None = None,
                                    implementation: str = "auto", interpret: bool = False,
                                    backend: str | None = None,
                                    block_sizes: PagedBlockSizes | None = None,
                                    precision: str = "highest") -> Float[Array, "B Hq D"]:
    """Decode attention over codes held in pages of P tokens, read through `block_table`
    [B, M] (-1 = unmapped, masked); row b's slot m * P + j is page block_table[b, m]'s
    token j, at position m * P + j.

    implementation: "auto" (the XLA reference `reference.vq_decode_attention_paged` on
      CPU, the paged Pallas kernels on TPU and CUDA: paged.py), "xla" or "pallas"; the
      kernels read each live page where the table points, with no gather of rows.
    block_sizes: pages per step / per split, Triton warps (paged_attention.BlockSizes);
      None: the backend's default (paged.default_block_sizes).
    precision: the kernels' dots, "highest" (f32) or "default" (TF32 on GPU).
    """
    if block_table.ndim != 2 or block_table.shape[0] != q.shape[0] or not jnp.issubdtype(
            block_table.dtype, jnp.integer):
        raise ValueError(f"block_table must be integer [B={q.shape[0]}, M], got "
                         f"{block_table.shape=} {block_table.dtype=}")
    _check_choice(implementation, backend)
    _validate_query(q, k_pages, v_pages, k_codebook, v_codebook, lengths, key_rope,
                    q.shape[0])
    return _vq_paged(q, k_pages, v_pages, k_codebook, v_codebook, block_table, lengths,
                     key_rope, implementation=implementation, interpret=interpret,
                     backend=backend, block_sizes=block_sizes, sm_scale=sm_scale,
                     precision=precision)


@functools.partial(jax.jit, static_argnames=("implementation", "interpret", "backend",
                                             "block_sizes", "sm_scale", "precision"))
def _vq_paged(q, k_pages, v_pages, k_codebook, v_codebook, block_table, lengths, key_rope, *,
              implementation, interpret, backend, block_sizes, sm_scale, precision):
    def xla(*a):
        return vq_decode_attention_paged(*a[:7], sm_scale=sm_scale,
                                         key_rope=a[7]).astype(q.dtype)

    def kernel(kind):
        return lambda *a: paged.vq_paged_decode_attention_pallas(
            *a, block_sizes=block_sizes, interpret=interpret, backend=kind,
            sm_scale=sm_scale, precision=precision)

    args = (q, k_pages, v_pages, k_codebook, v_codebook, block_table, lengths, key_rope)
    if backend is not None:
        return kernel(backend)(*args)
    cuda = kernel("triton")
    if implementation == "auto" and not (interpret or paged.gpu_supports(
            k_pages.shape[1], k_pages.shape[3], v_codebook.shape[3], q.shape[2])):
        cuda = xla  # shapes the compiled Triton kernel cannot tile: XLA on CUDA too
    return dispatch.dispatch(*args, implementation=implementation, xla=xla,
                             tpu=kernel("mosaic_tpu"), cuda=cuda)
