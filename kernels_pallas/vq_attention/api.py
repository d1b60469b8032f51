"""Public entry point: decode attention over VQ codes, `implementation="xla"|"pallas"`.

    out = vq_decode_attention(q, k_codes, v_codes, k_codebook, v_codebook, lengths,
                              implementation="pallas", interpret=True)   # CPU
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt8

from kernels_pallas.vq_attention.kernel import BACKENDS, BlockSizes, vq_decode_attention_pallas
from kernels_pallas.vq_attention.reference import vq_decode_attention_reference
from kernels_pallas.vq_attention.rope import KeyRope

IMPLEMENTATIONS = ("xla", "pallas")
_reference = jax.jit(vq_decode_attention_reference, static_argnames=("sm_scale", "block"))


def validate_codes_and_codebooks(k_codes, v_codes, k_codebook, v_codebook,
                                 n_kv_heads: int | None = None,
                                 head_dim: int | None = None) -> None:
    """Shapes/dtypes of codes [B, Hkv, G, S] uint8 and codebooks [Hc, G, K, g] float."""
    for name, c in (("k_codes", k_codes), ("v_codes", v_codes)):
        if c.ndim != 4 or c.dtype != jnp.uint8:
            raise TypeError(f"{name} must be uint8 [B, Hkv, G, S], got {c.shape=} {c.dtype=}")
    if k_codes.shape != v_codes.shape:
        raise ValueError(f"k_codes and v_codes must match, got {k_codes.shape=} "
                         f"{v_codes.shape=}")
    _, hkv, g, _ = k_codes.shape
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


def vq_decode_attention(q: Float[Array, "B Hq D"], k_codes: UInt8[Array, "B Hkv G S"],
                        v_codes: UInt8[Array, "B Hkv G S"], k_codebook: Float[Array, "Hc G K g"],
                        v_codebook: Float[Array, "Hc G K g"], lengths: Int[Array, "B"], *,
                        implementation: str = "xla", interpret: bool = False,
                        block_sizes: BlockSizes | None = None, backend: str = "triton",
                        sm_scale: float | None = None,
                        key_rope: KeyRope | None = None) -> Float[Array, "B Hq D"]:
    """Attention of one query token per row over the first `lengths[b]` coded tokens.

    implementation: "xla" (the plain-JAX reference: LUT gathers + per-code segment sums)
      or "pallas" (the kernel; `interpret=True` runs it on CPU, `backend` picks the
      Triton (CUDA) or Mosaic (TPU) compiler params).
    key_rope: the keys were coded before RoPE, in the codec channel order these tables
      describe (`KeyRope.from_permutation`); cache slot s holds position s.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if q.ndim != 3:
        raise ValueError(f"q must be [B, Hq, D], got {q.shape=}")
    validate_codes_and_codebooks(k_codes, v_codes, k_codebook, v_codebook,
                                 head_dim=q.shape[-1])
    b, hq, _ = q.shape
    if k_codes.shape[0] != b or hq % k_codes.shape[1]:
        raise ValueError(f"q {q.shape=} does not fit codes {k_codes.shape=} (batch must "
                         "match and Hq must be a multiple of Hkv)")
    if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths must be integer [B={b}], got {lengths.shape=} "
                         f"{lengths.dtype=}")
    if key_rope is not None:
        validate_key_rope(key_rope, k_codes.shape[1], q.shape[-1])
    if implementation == "xla":
        return _reference(q, k_codes, v_codes, k_codebook, v_codebook, lengths,
                          sm_scale=sm_scale, key_rope=key_rope).astype(q.dtype)
    return vq_decode_attention_pallas(q, k_codes, v_codes, k_codebook, v_codebook, lengths,
                                      key_rope, block_sizes=block_sizes or BlockSizes(),
                                      interpret=interpret, backend=backend,
                                      sm_scale=sm_scale)
