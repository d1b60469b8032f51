"""RoPE in a codec's channel order, for keys coded before RoPE (TaSQ pre-RoPE, CQ).

A pre-RoPE key code cannot be scored through one lookup table per query (the rotation
depends on the key's position), so readers rebuild each block of keys from the centroids
and rotate it at its positions. The codec stores channels permuted (codec channel c of KV
head h is model channel perm[h, c]); rather than un-permuting every block, the rotation is
expressed in codec order: with the model's half-split pairing (channel i rotates with
i + D/2),

    rot(x)[c] = x[c] * cos(omega[c] * p) + sign[c] * x[partner[c]] * sin(omega[c] * p)

where partner[c] is the codec position of perm[c]'s RoPE partner, omega[c] its frequency
and sign[c] = -1 for the first half of the model's channels, +1 for the second. The query
is in the same codec order, so q . rot(k) equals the model's score.

Positions are cache slots: slot s holds the token at absolute position s.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from flax import struct


@struct.dataclass
class KeyRope:
    """Per-KV-head rotation tables in codec channel order, each [Hkv, D]."""

    omega: Array    # f32 rotation frequency of each codec channel
    partner: Array  # int32 codec channel it rotates with
    sign: Array     # f32 -1 (model channel < D/2) or +1

    @classmethod
    def from_permutation(cls, perm: Int[Array, "H D"], theta: float) -> "KeyRope":
        """Tables for codec channel orders `perm` ([H, D], rows permutations of range(D)).
        Pure jnp, so a cache can derive them from its (traced) permutation inside jit."""
        perm = jnp.asarray(perm)
        if perm.ndim != 2 or perm.shape[1] % 2 or not jnp.issubdtype(perm.dtype, jnp.integer):
            raise ValueError(f"perm must be an integer [H, D] array with even D, got "
                             f"{perm.shape} {perm.dtype}")
        d = perm.shape[1]
        half = d // 2
        # numpy, not jnp: inside a jit trace even a closed-over constant's jnp ops are traced
        if not isinstance(perm, jax.core.Tracer) and not (
                np.sort(np.asarray(perm), axis=1) == np.arange(d)).all():
            raise ValueError("perm rows must be permutations of range(D)")
        # the same XLA ops as research.core.rope, so frequencies (and hence long-context
        # angles) are bit-identical to the model's
        inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
        partner = jnp.take_along_axis(jnp.argsort(perm, axis=1), (perm + half) % d, axis=1)
        return cls(inv_freq[perm % half], partner.astype(jnp.int32),
                   jnp.where(perm < half, -1.0, 1.0).astype(jnp.float32))

    def angles(self, positions: Int[Array, "S"]) -> Float[Array, "S H D"]:
        # The same product (f32 position x f32 frequency) as research.core.rope.rope_angles,
        # so that long-context angles round exactly as the model's do.
        return positions.astype(jnp.float32)[:, None, None] * self.omega[None]

    def cos_sin(self, positions: Int[Array, "S"]) -> tuple[Array, Array]:
        """cos and sin of `angles(positions)`, [S, H, D] each, with the transcendentals
        evaluated once per distinct frequency and gathered into codec order (a table built
        by `from_permutation` holds each of the D/2 frequencies twice per head; the
        gather is exact, the same f32 products). Computing them per channel and head was
        ~1.5 ms of a 4k-token decode read on CPU."""
        freqs = jnp.sort(self.omega[0])[::2]  # [D/2]
        index = jnp.searchsorted(freqs, self.omega)  # [H, D]
        ang = positions.astype(jnp.float32)[:, None] * freqs[None]  # [S, D/2]
        return jnp.cos(ang)[:, index], jnp.sin(ang)[:, index]

    def _partner(self, x: Float[Array, "... H R D"]) -> Array:
        return jnp.take_along_axis(x, jnp.broadcast_to(self.partner[:, None], x.shape), axis=-1)

    def rotate(self, x: Float[Array, "B S H D"], positions: Int[Array, "S"]) -> Array:
        """RoPE of codec-order keys x at `positions` (one position per slot, all rows)."""
        ang = self.angles(positions)[None]
        partner_x = jnp.take_along_axis(
            x, jnp.broadcast_to(self.partner[None, None], x.shape), axis=-1)
        return x * jnp.cos(ang) + self.sign * partner_x * jnp.sin(ang)

    def query_terms(self, q: Float[Array, "... H R D"], origin=0) -> tuple[Array, Array]:
        """(A, B) with q . rot_p(k) = sum_c k[c] (A[c] cos(omega_c j) + B[c] sin(omega_c j))
        for a key at position p = origin + j: A = q rotated by -origin (R(p) = R(origin)
        R(j)) and B[c] = -sign[c] A[partner[c]]. The rotation moves onto the query, so a
        reader multiplies keys by cos/sin tables of block-local offsets j and never mixes
        channels. q: R query rows per KV head H."""
        a = q
        if not (isinstance(origin, int) and origin == 0):
            ang = -jnp.asarray(origin, jnp.float32) * self.omega[:, None]  # [H, 1, D]
            a = q * jnp.cos(ang) + self.sign[:, None] * self._partner(q) * jnp.sin(ang)
        return a, -self.sign[:, None] * self._partner(a)
