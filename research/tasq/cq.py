"""CQ-style coupled quantisation (Zhang et al., 2024): adjacent channels coupled into one
code, keys quantised before RoPE.

Groups are runs of `g` adjacent channels (no permutation, no weighting, per-head
codebooks learnt by plain k-means: CQ's "uniform" centroid learning; its Fisher-guided
variant needs per-token gradients and is not reproduced). Because the codes hold pre-RoPE
keys, a per-query lookup table cannot serve every position: keys are rebuilt from the
centroids one block at a time and rotated at their positions inside an online softmax
(kernels_pallas/vq_attention: `vq_attention_blockwise` with a `KeyRope` for query chunks,
`vq_decode_attention_pre_rope` or the Pallas kernel for decode steps), so no dense K/V of
the whole context ever exists.

The cache receives post-RoPE keys from the model, so it un-rotates them (RoPE by -position,
exact up to float rounding) before encoding. `rope_theta` must be the model's.

Optional channel permutations ([Hkv, D], groups = runs of the permuted channels) make the
same codec serve TaSQ's pre-RoPE key space (covariance-aware grouping); CQ uses none. The
rotation is applied in the codec's channel order (KeyRope), so nothing is un-permuted
per block.

`key_read="rotated_table"` reads the same codes without rebuilding keys when every group
holds whole RoPE pairs (i, i + D/2): one table of query-centroid complex products per
query, rotated per token by its position's cos/sin (kernels_pallas/vq_attention/
rotated.py). It is the XLA read (implementation "xla", or "auto" on CPU) of decode steps
and of query chunks short enough for tables (`use_lookup_tables`); the Pallas kernels
(TPU, GPU, "pallas") and long prefill chunks still rebuild keys block by block, which gives
the same scores up to float rounding.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

import jax
from flax import struct

from kernels_pallas.vq_attention.api import vq_decode_attention
from kernels_pallas.vq_attention.reference import (dequantize, pre_rope_decode_scores,
                                                   values_from_code_weights,
                                                   vq_attention_blockwise,
                                                   vq_decode_attention_pre_rope)
from kernels_pallas.vq_attention.rope import KeyRope
from kernels_pallas.vq_attention.rotated import PairTables, vq_attention_rotated
from research.core.attention import attend
from research.core.rope import apply_rope
from research.kv.codec import KVCodec
from kernels_pallas.dispatch import IMPLEMENTATIONS
from research.tasq.vq import (check_kv_finite, encode, inverse_permutation, paged_codes_reader,
                              permute_channels)


KEY_READS = ("rebuild", "rotated_table")


@struct.dataclass
class CQCodec(KVCodec):
    """Records "k_codes", "v_codes" [Hkv, G] uint8 per token, keys coded before RoPE."""

    key_codebook: Array    # [Hkv, G, K, g] over pre-RoPE keys
    value_codebook: Array  # [Hkv, G, K, g]
    rope_theta: float = struct.field(pytree_node=False, default=10000.0)
    key_perm: Array | None = None    # [Hkv, D] int32: channel order of the key groups
    value_perm: Array | None = None  # [Hkv, D]
    label: str = struct.field(pytree_node=False, default="cq")
    # as VQCodec: raise on NaN/inf K/V inside jit too
    check_finite_in_jit: bool = struct.field(pytree_node=False, default=False)
    # decode steps: "auto" (XLA on CPU, the Pallas kernel on TPU/GPU), "xla" or "pallas"
    implementation: str = struct.field(pytree_node=False, default="auto")
    interpret: bool = struct.field(pytree_node=False, default=False)
    # keys rebuilt (or scored through rotated tables) per step of the XLA readers
    block: int = struct.field(pytree_node=False, default=512)
    # how the XLA reader scores keys: "rebuild" (centroids -> keys -> RoPE -> dot, block by
    # block) or "rotated_table" (one rotated table per query; groups must be whole RoPE
    # pairs: module docstring)
    key_read: str = struct.field(pytree_node=False, default="rebuild")

    def __post_init__(self):
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                             f"{self.implementation!r}")
        if self.key_read not in KEY_READS:
            raise ValueError(f"key_read must be one of {KEY_READS}, got {self.key_read!r}")
        if self.key_read == "rotated_table" and all(
                isinstance(x, (np.ndarray, jax.Array)) and not isinstance(x, jax.core.Tracer)
                for x in (self.key_codebook, self._key_order(1))):
            # concrete arrays (not the placeholders of tree utilities): a permutation
            # whose groups split a RoPE pair raises here, not as wrong scores later
            self.pair_tables(self.key_codebook.shape[1] * self.key_codebook.shape[3])

    def record_spec(self, n_kv_heads, head_dim):
        for name, cb in (("key_codebook", self.key_codebook),
                         ("value_codebook", self.value_codebook)):
            if cb.shape[0] not in (1, n_kv_heads) or cb.shape[1] * cb.shape[3] != head_dim:
                raise ValueError(f"{name} {cb.shape} does not fit {n_kv_heads} KV heads of "
                                 f"dim {head_dim}")
        codes = jax.ShapeDtypeStruct((n_kv_heads, self.key_codebook.shape[1]),
                                     jnp.dtype(jnp.uint8))
        return {"k_codes": codes, "v_codes": codes}

    def encode(self, k, v, positions):
        k_pre = apply_rope(k.astype(jnp.float32), -positions, self.rope_theta)
        return {"k_codes": encode(self._permute(k_pre, self.key_perm), self.key_codebook),
                "v_codes": encode(self._permute(v, self.value_perm), self.value_codebook)}

    def check_finite(self, k, v):
        return check_kv_finite(k, v, self.describe(), self.check_finite_in_jit)

    def attend(self, q, view):
        if not view.positional:  # ring slots are not positions: rotate rebuilt keys
            k, v = self.decode(view.records, view.kv_pos)
            return attend(q, k, v, view.q_pos, view.kv_pos, view.kv_valid, view.window)
        t, d = q.shape[1], q.shape[3]
        k_codes, v_codes = view.records["k_codes"], view.records["v_codes"]  # [B, S, Hkv, G]
        key_rope = self.key_rope(d)
        qp = permute_channels(q, self._key_order(d))
        if self.key_read == "rotated_table" and (
                (t == 1 and (view.window is not None or self.implementation == "xla"))
                or (t > 1 and self.use_lookup_tables(t, q.shape[2] // k_codes.shape[2],
                                                     k_codes.shape[1]))):
            out = self._rotated(qp, k_codes, v_codes, view.mask())
        elif self.key_read == "rotated_table" and t == 1:  # "auto"/"pallas" decode step
            def rotated(*a):
                return self._rotated(a[0][:, None], *a[1:3], a[3])[:, 0].astype(a[0].dtype)

            def kernel(*a):
                return vq_decode_attention(a[0], a[1], a[2], self.key_codebook,
                                           self.value_codebook, a[4],
                                           implementation=self.implementation,
                                           interpret=self.interpret, key_rope=key_rope)
            args = (qp[:, 0], k_codes, v_codes, view.mask(), view.lengths)
            out = (kernel(*args) if self.implementation == "pallas" else
                   jax.lax.platform_dependent(*args, cpu=rotated, default=kernel))
            out = out[:, None].astype(jnp.float32)
        elif t == 1 and view.window is None:  # decode step: the Pallas kernel or two passes
            codes = (qp[:, 0], k_codes, v_codes, self.key_codebook, self.value_codebook,
                     view.lengths)
            if self.implementation != "xla":
                out = vq_decode_attention(*codes, implementation=self.implementation,
                                          interpret=self.interpret, key_rope=key_rope)
            else:
                out = vq_decode_attention_pre_rope(*codes, key_rope, self.block)
            out = out[:, None].astype(jnp.float32)
        else:
            out = vq_attention_blockwise(qp, k_codes, v_codes, self.key_codebook,
                                         self.value_codebook, view.mask(), block=self.block,
                                         key_rope=key_rope)
        return self._unpermute(out, self.value_perm).astype(q.dtype)

    def _rotated(self, qp, k_codes, v_codes, mask):
        return vq_attention_rotated(qp, k_codes, v_codes, self.key_codebook,
                                    self.value_codebook, mask,
                                    self.pair_tables(qp.shape[-1]), self.block)

    def use_lookup_tables(self, t: int, q_per_kv: int, context: int) -> bool:
        """Rotated tables for a query chunk when they are smaller than the context they
        summarise (as VQCodec's); longer chunks rebuild keys per block."""
        return t * q_per_kv * self.key_codebook.shape[2] <= context

    def pair_tables(self, head_dim: int) -> PairTables:
        """Where each key group's RoPE pairs sit (rotated-table read)."""
        return PairTables.from_permutation(self._key_order(head_dim),
                                           self.key_codebook.shape[3], self.rope_theta)

    def page_reader(self, window, read):
        """Decode steps on code pages: the paged VQ kernel with the keys' RoPE tables
        (kernels_pallas.vq_attention.paged); none for windows or "xla"."""
        return paged_codes_reader(self, window, read, key_rope=self.key_rope(
            self.key_codebook.shape[1] * self.key_codebook.shape[3]))

    def decode_scores(self, q, records):
        """The rebuild read's scores (keys rebuilt a block at a time); None for the
        rotated-table read."""
        if self.key_read != "rebuild":
            return None
        d = q.shape[-1]
        qp = permute_channels(q[:, None], self._key_order(d))[:, 0]
        return pre_rope_decode_scores(qp, records["k_codes"], self.key_codebook,
                                      self.key_rope(d), self.block)

    def weighted_values(self, weights, records):
        b, hkv, j, _ = weights.shape
        out = values_from_code_weights(weights, records["v_codes"], self.value_codebook)
        out = out.reshape(b, 1, hkv * j, -1)
        return self._unpermute(out, self.value_perm)[:, 0]

    def key_perm_or_identity(self, head_dim: int) -> Array:
        return self._key_order(head_dim)

    def decode(self, records, positions):
        """Dense post-RoPE K and V (the ring layout's reader; positional layouts never
        build them)."""
        k_pre = self._unpermute(dequantize(records["k_codes"], self.key_codebook),
                                self.key_perm)
        v = self._unpermute(dequantize(records["v_codes"], self.value_codebook),
                            self.value_perm)
        return apply_rope(k_pre, positions, self.rope_theta), v

    def _key_order(self, head_dim: int) -> Array:
        return jnp.arange(head_dim)[None] if self.key_perm is None else self.key_perm

    def key_rope(self, head_dim: int) -> KeyRope:
        """RoPE tables of the coded keys, in the codec's channel order."""
        return KeyRope.from_permutation(self._key_order(head_dim), self.rope_theta)

    @staticmethod
    def _permute(x, perm):
        return x if perm is None else permute_channels(x, perm)

    @staticmethod
    def _unpermute(x, perm):
        return x if perm is None else permute_channels(x, inverse_permutation(perm))

    def describe(self):
        hc, g, k, gs = self.key_codebook.shape
        groups = "adjacent" if self.key_perm is None else "permuted"
        read = ", rotated-table read" if self.key_read == "rotated_table" else ""
        return f"{self.label}[pre-RoPE keys, {g}x{gs}ch {groups} groups, {k} centroids{read}]"
