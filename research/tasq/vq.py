"""Vector-quantised KV codec: one uint8 code per (token, KV head, channel group).

Channels of each head are permuted (`key_perm`/`value_perm`, data: free at run time, an
index gather of q and of the output), cut into G contiguous groups of g channels, and each
group is replaced by the index of its nearest centroid (K <= 256 centroids per group, so
a code is one byte: 1 bit per channel at g=8, K=256). Codebooks are array leaves of the
cache object, so calibrated codebooks travel through `jit` as data.

Attention reads the codes directly (kernels_pallas/vq_attention): key scores through
per-query lookup tables, values through per-code bins. The chunk being written is encoded
first and then read back from codes like every older token, so prefill (and perplexity)
sees exactly what decode will see.

Keys are quantised after RoPE: a post-RoPE key is what every query dots with, so one
lookup table per query serves every position. The codec knows nothing about where its
channel scales came from; research/tasq folds them into the projection weights.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, UInt8

from kernels_pallas.dispatch import IMPLEMENTATIONS
from kernels_pallas.vq_attention.api import (validate_codes_and_codebooks, vq_decode_attention,
                                             vq_decode_attention_paged_codes)
from kernels_pallas.vq_attention.reference import (dequantize, lookup_table_decode_scores,
                                                   values_from_code_weights,
                                                   vq_attention_blockwise,
                                                   vq_attention_reference)
from research.kv.codec import KVCodec
from flax import struct



def nearest(d: Float[Array, "K N"]) -> tuple[Array, Array]:
    """(argmin over axis 0, min) of non-negative distances [K <= 256, N], in one integer min.

    XLA:CPU's variadic argmin reduce is ~10x slower than a min, so the low 8 bits of each
    f32 distance are replaced by the centroid index: the winner is within a relative 2^-15
    of the true nearest (only near-ties can differ from an exact argmin). Distances laid
    out [K, N] reduce ~3x faster than [N, K] there.
    """
    bits = jax.lax.bitcast_convert_type(jnp.maximum(d, 0.0), jnp.int32)
    keyed = (bits & ~0xFF) | jnp.arange(d.shape[0], dtype=jnp.int32)[:, None]
    best = jnp.min(keyed, axis=0)
    return best & 0xFF, jax.lax.bitcast_convert_type(best & ~0xFF, jnp.float32)


# Distances (floats) up to which `encode` searches every (head, group) pair at once: a
# decode step's few tokens, where the loop's per-iteration overhead dominated (a SmolLM2
# decode step at batch 4 spent ~24 ms of ~250 in the 30 layers' encode loops on CPU).
_ONE_PROGRAM_DISTANCES = 1 << 20


def encode(x: Float[Array, "B T H D"], codebook: Float[Array, "Hc G K g"]
           ) -> UInt8[Array, "B T H G"]:
    """Nearest centroid (L2) of every channel group.

    Distances are laid out [K, N] and reduced with `nearest` (one integer min): the chosen
    centroid is within a relative 2^-15 of the true nearest distance. The (head, group)
    pairs run as one `lax.map` body rather than H * G unrolled copies: a whole-model TaSQ
    decode step compiled ~5x faster that way on CPU (48 copies per layer at 1 bit), and a
    [K, N] tile per pair stays in cache (4x faster than the unrolled loop at N = 7,680).
    A few tokens (decode) take one vmapped search instead of the loop.
    """
    b, t, h, d = x.shape
    _, g, k, gs = codebook.shape
    xg = x.astype(jnp.float32).reshape(b * t, h * g, gs).transpose(1, 0, 2)  # [H*G, N, gs]
    cb = jnp.broadcast_to(codebook.astype(jnp.float32), (h, g, k, gs)).reshape(h * g, k, gs)

    def pair(c_and_x):
        c, xs = c_and_x  # [K, gs], [N, gs]
        dist = (jnp.sum(c * c, -1)[:, None] - 2 * c @ xs.T
                + jnp.sum(xs * xs, -1)[None, :])
        return nearest(dist)[0]

    if h * g * k * b * t <= _ONE_PROGRAM_DISTANCES:  # decode: a few tokens per call
        codes = jax.vmap(pair)((cb, xg))  # [H*G, N]
    else:
        codes = jax.lax.map(pair, (cb, xg))  # [H*G, N]
    return codes.T.reshape(b, t, h, g).astype(jnp.uint8)


def permute_channels(x: Float[Array, "B T H D"], perm: Int[Array, "Hp D"]) -> Array:
    """out[..., h, c] = x[..., h, perm[h', c]] with h' = h // (H / Hp) (query heads of a
    KV group share its permutation)."""
    h, hp = x.shape[2], perm.shape[0]
    idx = jnp.repeat(perm, h // hp, axis=0)[None, None]
    return jnp.take_along_axis(x, jnp.broadcast_to(idx, x.shape), axis=-1)


def inverse_permutation(perm: Int[Array, "H D"]) -> Int[Array, "H D"]:
    return jnp.argsort(perm, axis=-1).astype(jnp.int32)


def paged_codes_reader(codec, window, read, key_rope=None):
    """A VQ-style codec's page reader (VQCodec, CQCodec): queries in the codec's key
    channel order, the paged kernel over "k_codes"/"v_codes" pages, values back in model
    order. None where the codec's own choice is "xla" or the layer has a window."""
    if window is not None or codec.implementation == "xla":
        return None
    implementation = "pallas" if "pallas" in (read.implementation,
                                              codec.implementation) else "auto"

    def reader(q, pages, table, lengths):
        qp = permute_channels(q[:, None], codec.key_perm_or_identity(q.shape[-1]))[:, 0]
        out = vq_decode_attention_paged_codes(
            qp, pages["k_codes"], pages["v_codes"], codec.key_codebook, codec.value_codebook,
            table, lengths, key_rope=key_rope, implementation=implementation,
            backend=read.backend, interpret=read.interpret or codec.interpret)
        if codec.value_perm is None:
            return out
        return permute_channels(out[:, None], inverse_permutation(codec.value_perm))[:, 0]
    return reader


def _raise_if_nonfinite(bad, name: str, where: str) -> None:
    if bad:
        raise ValueError(f"{name} contains NaN or inf ({where}); a VQ code cannot represent it")


def check_kv_finite(k, v, where: str, in_jit_check: bool) -> Array:
    """Per-row flag of non-finite K/V. Concrete inputs raise now; under jit a callback raises
    when `in_jit_check` (costs a host round trip per call, like jax_debug_nans)."""
    bad_k = ~jnp.all(jnp.isfinite(k), axis=(1, 2, 3))
    bad_v = ~jnp.all(jnp.isfinite(v), axis=(1, 2, 3))
    for name, bad in (("k", bad_k), ("v", bad_v)):
        if not isinstance(bad, jax.core.Tracer):
            _raise_if_nonfinite(bool(jnp.any(bad)), name, where)
        elif in_jit_check:
            jax.debug.callback(_raise_if_nonfinite, jnp.any(bad), name, where)
    return bad_k | bad_v


@struct.dataclass
class VQCodec(KVCodec):
    """Keys and values as uint8 VQ codes, one per (token, KV head, group); see the module
    docstring. Records: "k_codes", "v_codes" [Hkv, G] per token.

    key_codebook / value_codebook: [Hc, G, K, g] (Hc = 1: shared by all KV heads).
    key_perm / value_perm: [Hkv, D] int32; codec channel c of head h holds channel perm[h, c].
    implementation: single-token decode steps in a positional layout go through
      `kernels_pallas.vq_attention` with this choice: "auto" (default: XLA on CPU, the
      Pallas kernel on TPU and GPU, chosen at lowering), "xla" (the lookup-table
      reference for every chunk) or "pallas".
    check_finite_in_jit: raise on NaN/inf K/V inside jit too (a host callback per call). Without
      it, rows whose new K/V are not finite get NaN outputs, never a silently wrong code.
    """

    key_codebook: Array
    value_codebook: Array
    key_perm: Array
    value_perm: Array
    implementation: str = struct.field(pytree_node=False, default="auto")
    interpret: bool = struct.field(pytree_node=False, default=False)
    check_finite_in_jit: bool = struct.field(pytree_node=False, default=False)
    label: str = struct.field(pytree_node=False, default="vq")

    def __post_init__(self):
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                             f"{self.implementation!r}")

    @classmethod
    def create(cls, key_codebook, value_codebook, key_perm=None, value_perm=None,
               **static) -> "VQKVCache":
        """Validated construction from concrete arrays (identity permutations by default)."""
        key_codebook = jnp.asarray(key_codebook)
        value_codebook = jnp.asarray(value_codebook)
        for name, cb in (("key_codebook", key_codebook), ("value_codebook", value_codebook)):
            if cb.ndim != 4 or cb.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
                raise TypeError(f"{name} must be a float32/bfloat16/float16 [Hc, G, K, g] "
                                f"array, got {cb.shape=} {cb.dtype=}")
            if not bool(jnp.all(jnp.isfinite(cb))):
                raise ValueError(f"{name} contains NaN or inf")
        if key_codebook.shape[1:] != value_codebook.shape[1:]:
            raise ValueError(f"key and value codebooks must have equal [G, K, g], got "
                             f"{key_codebook.shape=} {value_codebook.shape=}")
        hc, g, k, gs = key_codebook.shape
        if k > 256:
            raise ValueError(f"codebooks have {k} centroids; a uint8 code addresses <= 256")
        d = g * gs
        perms = []
        for name, p in (("key_perm", key_perm), ("value_perm", value_perm)):
            p = np.tile(np.arange(d), (hc, 1)) if p is None else np.asarray(p)
            if p.ndim != 2 or p.shape[1] != d or not np.issubdtype(p.dtype, np.integer):
                raise ValueError(f"{name} must be an integer [Hkv, D={d}] array, got "
                                 f"{p.shape} {p.dtype}")
            if not (np.sort(p, axis=1) == np.arange(d)).all():
                raise ValueError(f"{name} rows must be permutations of range({d})")
            perms.append(jnp.asarray(p, jnp.int32))
        return cls(key_codebook, value_codebook, perms[0], perms[1], **static)

    def key_perm_or_identity(self, head_dim: int) -> Array:
        return self.key_perm

    @property
    def n_groups(self) -> int:
        return self.key_codebook.shape[1]

    def _check_layout(self, n_kv_heads: int, head_dim: int) -> None:
        validate_codes_and_codebooks(
            jax.ShapeDtypeStruct((1, 1, n_kv_heads, self.n_groups), jnp.uint8),
            jax.ShapeDtypeStruct((1, 1, n_kv_heads, self.n_groups), jnp.uint8),
            self.key_codebook, self.value_codebook, n_kv_heads, head_dim)
        for name, p in (("key_perm", self.key_perm), ("value_perm", self.value_perm)):
            if p.shape[1] != head_dim or p.shape[0] not in (1, n_kv_heads):
                raise ValueError(f"{name} must be [1 or {n_kv_heads}, {head_dim}], got "
                                 f"{p.shape}")

    def record_spec(self, n_kv_heads, head_dim):
        self._check_layout(n_kv_heads, head_dim)
        codes = jax.ShapeDtypeStruct((n_kv_heads, self.n_groups), jnp.dtype(jnp.uint8))
        return {"k_codes": codes, "v_codes": codes}

    def encode(self, k, v, positions):
        self._check_layout(k.shape[2], k.shape[3])
        return {"k_codes": encode(permute_channels(k, self.key_perm), self.key_codebook),
                "v_codes": encode(permute_channels(v, self.value_perm), self.value_codebook)}

    def check_finite(self, k, v):
        return check_kv_finite(k, v, self.describe(), self.check_finite_in_jit)

    def attend(self, q, view):
        t, hkv = q.shape[1], self.key_perm.shape[0]
        k_codes, v_codes = view.records["k_codes"], view.records["v_codes"]  # [B, S, Hkv, G]
        qp = permute_channels(q, self.key_perm)
        if (self.implementation != "xla" and view.positional and t == 1
                and view.window is None):
            out = vq_decode_attention(qp[:, 0], k_codes, v_codes, self.key_codebook,
                                      self.value_codebook, view.lengths,
                                      implementation=self.implementation,
                                      interpret=self.interpret)
            out = out[:, None].astype(jnp.float32)
        else:
            attn = (vq_attention_reference
                    if self.use_lookup_tables(t, q.shape[2] // hkv, k_codes.shape[1])
                    else vq_attention_blockwise)
            out = attn(qp, k_codes, v_codes, self.key_codebook, self.value_codebook,
                       view.mask())
        return permute_channels(out, inverse_permutation(self.value_perm)).astype(q.dtype)

    def decode_scores(self, q, records):
        """The lookup-table read's scores: one table per query serves every position."""
        qp = permute_channels(q[:, None], self.key_perm)[:, 0]
        return lookup_table_decode_scores(qp, records["k_codes"], self.key_codebook)

    def weighted_values(self, weights, records):
        b, hkv, j, _ = weights.shape
        out = values_from_code_weights(weights, records["v_codes"], self.value_codebook)
        out = out.reshape(b, 1, hkv * j, -1)
        return permute_channels(out, inverse_permutation(self.value_perm))[:, 0]

    def decode(self, records, positions):
        """Dense post-RoPE K and V rebuilt from the codes (a full-precision window's mixed
        read, research/kv/windowed.py; the reads above score codes without it)."""
        k = dequantize(records["k_codes"], self.key_codebook)
        v = dequantize(records["v_codes"], self.value_codebook)
        return (permute_channels(k, inverse_permutation(self.key_perm)),
                permute_channels(v, inverse_permutation(self.value_perm)))

    def page_reader(self, window, read):
        """Decode steps on code pages: the paged VQ kernel reads each live page through the
        block table (kernels_pallas.vq_attention.paged); none for windows or "xla"."""
        return paged_codes_reader(self, window, read)

    def use_lookup_tables(self, t: int, q_per_kv: int, context: int) -> bool:
        """Lookup tables (T * q_per_kv rows of K entries per group) when they are smaller
        than the context they summarise; long prefill chunks rebuild K/V per block."""
        return t * q_per_kv * self.key_codebook.shape[2] <= context

    def describe(self):
        hc, g, k, gs = self.key_codebook.shape
        bits = np.log2(k) / gs
        return f"{self.label}[{bits:g}b/ch, {g}x{gs}ch groups, {k} centroids, Hc={hc}]"
