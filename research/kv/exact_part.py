"""An ablation codec: one of K or V kept exact (bfloat16), the other through any codec.

A low-bit codec loses a model's retrieval (passkey) long before its perplexity moves
(experiments/serving/README.md); keeping its keys exact while its values go through the
codec, and the reverse, says which half of the cache the loss comes from, measured rather
than argued.

`ExactPartCodec(inner, part="k")` stores the inner codec's records plus a bfloat16 copy
of K ("k_exact"); a read rebuilds dense K/V with `inner.decode` and replaces K by the
copy (so it is read through the reference attention, not the inner codec's fast reads:
an ablation, not a serving codec). Its bytes are counted like any codec's (the inner
records plus 2 bytes per channel of the exact part; the inner codec's codes for that part
are stored but unused). `kv_exact_part(part)` is the transform, applied after the codec.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from research.kv.codec import KVCodec
from research.kv.layouts import wrap_codecs
from research.transforms import Transform, stateless

PARTS = ("k", "v")


@struct.dataclass
class ExactPartCodec(KVCodec):
    """`inner`'s records plus a bfloat16 copy of `part` ("k" or "v"), read in its place."""

    inner: KVCodec
    part: str = struct.field(pytree_node=False, default="k")

    def __post_init__(self):
        if not isinstance(self.inner, KVCodec):
            raise TypeError(f"inner must be a KVCodec, got {type(self.inner).__name__}")
        if self.part not in PARTS:
            raise ValueError(f"part must be one of {PARTS}, got {self.part!r}")
        if (type(self.inner).write is not KVCodec.write or self.inner.align != 1
                or self.inner.lookback):
            raise ValueError(f"{self.inner.describe()} writes its own records (groups of "
                             "tokens or a window); an exact part over it is not supported "
                             "(token codecs only)")
        if type(self.inner).decode is KVCodec.decode:
            raise ValueError(f"{self.inner.describe()} has no dense decode to replace a "
                             "part of")

    @property
    def exact_name(self) -> str:
        return f"{self.part}_exact"

    def record_spec(self, n_kv_heads, head_dim):
        spec = self.inner.record_spec(n_kv_heads, head_dim)
        if self.exact_name in spec:
            raise ValueError(f"{self.inner.describe()} already has a record named "
                             f"{self.exact_name!r}")
        exact = jax.ShapeDtypeStruct((n_kv_heads, head_dim), jnp.dtype(jnp.bfloat16))
        return {**spec, self.exact_name: exact}

    def encode(self, k, v, positions):
        exact = k if self.part == "k" else v
        return {**self.inner.encode(k, v, positions),
                self.exact_name: exact.astype(jnp.bfloat16)}

    def decode(self, records, positions):
        inner = {n: r for n, r in records.items() if n != self.exact_name}
        k, v = self.inner.decode(inner, positions)
        exact = records[self.exact_name]
        if self.part == "k":
            return exact.astype(k.dtype), v
        return k, exact.astype(v.dtype)

    def check_finite(self, k, v):
        return self.inner.check_finite(k, v)

    def describe(self):
        return f"{self.inner.describe()} with {self.part.upper()} in bfloat16"


def kv_exact_part(part: str) -> Transform:
    """Transform: every layer's codec (installed by a transform before it) keeps `part`
    ("k" or "v") in bfloat16 and reads only the other through the codec."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")

    def apply(model, state):
        del state
        return wrap_codecs(model, lambda codec: ExactPartCodec(codec, part),
                           "kv_exact_part", f"{part}-bf16")

    return stateless(apply, f"kv_exact_part({part!r})")
