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
"""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array

from kernels_pallas.vq_attention.api import vq_decode_attention
from kernels_pallas.vq_attention.reference import (vq_attention_blockwise,
                                                   vq_decode_attention_pre_rope)
from kernels_pallas.vq_attention.rope import KeyRope
from research.core.attention import attention_mask
from flax import struct
from research.core.rope import apply_rope
from research.kv.base import KVCache, write_positions
from research.tasq.vq import (IMPLEMENTATIONS, check_kv_finite, encode, inverse_permutation,
                            permute_channels, scatter_codes)


@struct.dataclass
class CQKVCache(KVCache):
    key_codebook: Array    # [Hkv, G, K, g] over pre-RoPE keys
    value_codebook: Array  # [Hkv, G, K, g]
    rope_theta: float = struct.field(pytree_node=False, default=10000.0)
    key_perm: Array | None = None    # [Hkv, D] int32: channel order of the key groups
    value_perm: Array | None = None  # [Hkv, D]
    label: str = struct.field(pytree_node=False, default="cq")
    check_finite: bool = struct.field(pytree_node=False, default=False)  # as VQKVCache: raise inside jit too
    implementation: str = struct.field(pytree_node=False, default="xla")  # "pallas": the kernel for decode steps
    interpret: bool = struct.field(pytree_node=False, default=False)
    block: int = struct.field(pytree_node=False, default=512)  # keys rebuilt per step of the XLA readers

    def __post_init__(self):
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                             f"{self.implementation!r}")

    def init(self, batch, max_len, n_kv_heads, head_dim):
        for name, cb in (("key_codebook", self.key_codebook),
                         ("value_codebook", self.value_codebook)):
            if cb.shape[0] not in (1, n_kv_heads) or cb.shape[1] * cb.shape[3] != head_dim:
                raise ValueError(f"{name} {cb.shape} does not fit {n_kv_heads} KV heads of "
                                 f"dim {head_dim}")
        shape = (batch, n_kv_heads, self.key_codebook.shape[1], max_len)
        return {"k_codes": jnp.zeros(shape, jnp.uint8), "v_codes": jnp.zeros(shape, jnp.uint8)}

    def update_and_attend(self, state, q, k, v, *, start, n_new, window):
        b, t, _, d = k.shape
        bad_rows = check_kv_finite(k, v, self.describe(), self.check_finite)
        s = state["k_codes"].shape[-1]
        q_pos = start[:, None] + jnp.arange(t)[None, :]
        k_pre = apply_rope(k.astype(jnp.float32), -q_pos, self.rope_theta)
        slots = write_positions(start, n_new, t, s)
        k_codes = encode(self._permute(k_pre, self.key_perm), self.key_codebook)
        v_codes = encode(self._permute(v, self.value_perm), self.value_codebook)
        state = {"k_codes": scatter_codes(state["k_codes"], slots, k_codes),
                 "v_codes": scatter_codes(state["v_codes"], slots, v_codes)}
        key_perm = self._key_order(d)
        key_rope = self.key_rope(d)
        qp = permute_channels(q, key_perm)
        if t == 1 and window is None:  # decode step: the Pallas kernel or the two-pass read
            codes = (qp[:, 0], state["k_codes"], state["v_codes"], self.key_codebook,
                     self.value_codebook, start + n_new)
            if self.implementation == "pallas":
                out = vq_decode_attention(*codes, implementation="pallas",
                                          interpret=self.interpret, key_rope=key_rope)
            else:
                out = vq_decode_attention_pre_rope(*codes, key_rope, self.block)
            out = out[:, None].astype(jnp.float32)
        else:
            kv_pos = jnp.broadcast_to(jnp.arange(s)[None, :], (b, s))
            mask = attention_mask(q_pos, kv_pos, kv_pos < (start + n_new)[:, None], window)
            out = vq_attention_blockwise(qp, state["k_codes"], state["v_codes"],
                                         self.key_codebook, self.value_codebook, mask,
                                         block=self.block, key_rope=key_rope)
        out = self._unpermute(out, self.value_perm)
        # A row whose K/V were not finite got junk codes: poison it rather than hide it.
        return jnp.where(bad_rows[:, None, None, None], jnp.nan, out).astype(q.dtype), state

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
        return f"{self.label}[pre-RoPE keys, {g}x{gs}ch {groups} groups, {k} centroids]"
