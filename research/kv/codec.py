"""KV codecs: *how* one token's K and V are encoded, independent of *where* they live.

A codec turns a chunk of post-RoPE K/V into per-token records (a dict of arrays whose
leading axes are [batch, token]) and attends over records it wrote. A layout
(research/kv/dense.py, window.py, paged.py) decides where the records live: a dense
[B, S] buffer, a ring of the last W tokens, or pages of a shared block pool. Any codec
works in any layout because a layout only scatters and gathers records along their token
axis; it never looks inside them.

    records = codec.encode(k, v, positions)              # {name: [B, T, *record]}
    out = codec.attend(q, view)                           # view: records [B, S, ...] + masks

Codecs that score keys without rebuilding them (VQ lookup tables, sign sketches) override
`attend`; the default rebuilds dense K/V with `decode` and runs the reference attention.

Codecs with a paged decode kernel override `page_reader`: the paged layout then hands
decode steps (one query token per row) the pages and the block table themselves, so the
kernel reads each live page where the table points instead of the layout gathering every
row's pages first (float: kernels_pallas.paged_attention; int8: the same kernel with
scales; VQ codes: kernels_pallas.vq_attention.paged). This is the one place the layout
and a kernel meet; a codec without a reader is always read through `attend`.

Codecs whose records depend on a group of tokens (KIVI: per-channel key scales over
`align` consecutive positions) override `write` instead of `encode`: it may re-emit the
records of earlier positions of the chunk's first group (`Written.positions`), and keep a
small per-sequence state (`init_seq_state`: KIVI's full-precision residual ring) that the
layout stores per row under "seq". Layouts keep slot groups aligned: dense buffers and
window rings are multiples of `align`, paged blocks too (block_size % align == 0).

A codec whose `write` must see the tokens just before a chunk (a full-precision window
over KIVI rewrites the chunk's first group from its own bfloat16 copies instead of a
per-sequence ring: research/kv/windowed.py) sets `lookback` > 0; every layout then hands
`write` the stored records of the `lookback` positions before each row's chunk
(`earlier`). This is the one place the protocol lets a write read the cache.
"""
from __future__ import annotations

import abc
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from kernels_pallas.paged_attention.api import paged_decode_attention
from research.core.attention import attend, attention_mask

Records = dict  # {name: Array [..., *record]} with the token axes leading
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


SEQ = "seq"  # the key of a codec's per-sequence state in a layout's state dict


class KVView(NamedTuple):
    """What a layout hands a codec to attend over (S storage slots per row).

    positional: slot s of every row holds position s (dense and paged layouts), so a row's
      valid slots are exactly [0, lengths[b]), its queries are at start + arange(T), and
      position-aware fast paths (decode kernels, pre-RoPE block readers, the window's
      banded chunk read) may assume it. False for the window ring.
    lengths: [B] tokens each row holds after the write (positional layouts only).
    """

    records: Records
    q_pos: Int[Array, "B T"]
    kv_pos: Int[Array, "B S"]
    kv_valid: Bool[Array, "B S"]
    window: int | None
    positional: bool
    lengths: Int[Array, "B"] | None = None
    extra: Records | None = None  # what `write` left for `attend` (Written.extra)

    def mask(self) -> Bool[Array, "B T S"]:
        return attention_mask(self.q_pos, self.kv_pos, self.kv_valid, self.window)


class PageRead(NamedTuple):
    """The paged layout's kernel choice, passed to `KVCodec.page_reader`."""

    implementation: str  # "auto" | "pallas" (the layout never asks for a reader with "xla")
    backend: str | None  # with "pallas": None (the platform's) | "mosaic_tpu" | "triton"
    interpret: bool


# reader(q [B, Hq, D], pages {record: [N, block_size, *record]} in the codec's dtypes,
#        block_table [B, M], lengths [B]) -> [B, Hq, D]
PageReader = Callable[[Array, Records, Array, Array], Array]


def decode_through_reader(reader: PageReader, implementation: str, q, pages: Records, table,
                          lengths, fallback: Callable) -> Array:
    """A decode step's output [B, 1, Hq, D] read by a codec's page reader (its Pallas
    kernel): "pallas" everywhere; "auto" on TPU and GPU, with `fallback(q, pages, table,
    lengths)` (the layout's own XLA read) on CPU, chosen when the step is lowered."""
    def kernel(q, pages, table, lengths):
        return reader(q[:, 0], pages, table, lengths)[:, None].astype(q.dtype)
    if implementation == "pallas":
        return kernel(q, pages, table, lengths)
    return jax.lax.platform_dependent(q, pages, table, lengths,
                                      cpu=lambda *a: fallback(*a).astype(q.dtype),
                                      default=kernel)


class Written(NamedTuple):
    """What a codec's `write` hands the layout.

    records: [B, T', *record] to store at `positions` [B, T'] where `valid` [B, T'].
    seq_state: the per-sequence state to keep (None for codecs without one).
    extra: anything `attend` needs besides the stored records (put in `KVView.extra`).
    bad_rows: [B] rows whose write could not be done exactly (NaN out), or None.
    """

    records: Records
    positions: Int[Array, "B T2"]
    valid: Bool[Array, "B T2"]
    seq_state: Records | None = None
    extra: Records | None = None
    bad_rows: Array | None = None


class KVCodec(abc.ABC):
    """Abstract codec. Subclasses are `flax.struct.dataclass`es (arrays = leaves)."""

    align = 1  # slot-group size the layouts keep aligned (positions p // align share one)
    lookback = 0  # stored positions before a chunk that `write` reads (`earlier`)

    @abc.abstractmethod
    def record_spec(self, n_kv_heads: int, head_dim: int) -> dict[str, jax.ShapeDtypeStruct]:
        """Per-token record shapes and dtypes (no token axes); validates the head layout."""

    @abc.abstractmethod
    def encode(self, k: Float[Array, "B T Hkv D"], v: Float[Array, "B T Hkv D"],
               positions: Int[Array, "B T"]) -> Records:
        """Records [B, T, *record] of a chunk of post-RoPE keys and values."""

    def init_seq_state(self, batch: int, n_kv_heads: int, head_dim: int) -> Records | None:
        """Per-sequence state of `batch` rows (None: the codec keeps none)."""
        return None

    def write(self, k: Float[Array, "B T Hkv D"], v: Float[Array, "B T Hkv D"],
              positions: Int[Array, "B T"], valid: Bool[Array, "B T"],
              seq_state: Records | None, earlier: Records | None = None) -> Written:
        """Records of a chunk for the layout to store (default: `encode`, token by token).

        earlier: with `lookback` = L > 0, the stored records [B, L, *record] of positions
          start - L .. start - 1 of each row (start = positions[:, 0]); entries at negative
          positions are unspecified. None when L = 0."""
        return Written(self.encode(k, v, positions), positions, valid, seq_state)

    def encode_groups(self, k: Float[Array, "B N Hkv D"], v: Float[Array, "B N Hkv D"],
                      valid: Bool[Array, "B N"]) -> Records:
        """Records of whole `align`-position groups (N = groups x align, group-aligned)
        from their full-precision K/V, only `valid` tokens counted: how a codec whose
        records depend on a group (KIVI) lets a full-precision window write them from its
        own copies (research/kv/windowed.py). Default: not a grouped codec."""
        raise NotImplementedError(f"{self.describe()} does not encode position groups")

    def decode(self, records: Records, positions: Int[Array, "B S"]
               ) -> tuple[Float[Array, "B S Hkv D"], Float[Array, "B S Hkv D"]]:
        """Dense post-RoPE K and V rebuilt from records (codecs that override `attend`
        without a dense form may leave this unimplemented)."""
        raise NotImplementedError(f"{self.describe()} has no dense decode")

    def attend(self, q: Float[Array, "B T Hq D"], view: KVView) -> Float[Array, "B T Hq D"]:
        """Causal attention of q over the view's records (default: decode + reference)."""
        k, v = self.decode(view.records, view.kv_pos)
        return attend(q, k, v, view.q_pos, view.kv_pos, view.kv_valid, view.window)

    def decode_scores(self, q: Float[Array, "B Hq D"], records: Records
                      ) -> Float[Array, "B Hkv J S"] | None:
        """Scaled scores (q . k / sqrt(D)) of one decode query per row against every
        record, without rebuilding K, or None (default): a codec that has them lets a
        full-precision window (research/kv/windowed.py) read its codes at the codec's
        speed, merging its own scores into one softmax. J = Hq / Hkv."""
        return None

    def weighted_values(self, weights: Float[Array, "B Hkv J S"], records: Records
                        ) -> Float[Array, "B Hq D"]:
        """sum_s weights[..., s] * V(records[s]) (with `decode_scores`)."""
        raise NotImplementedError(f"{self.describe()} has no weighted_values")

    def page_reader(self, window: int | None, read: PageRead) -> PageReader | None:
        """A decode-step reader straight from pages through the block table (module
        docstring), or None (default): the layout gathers the live pages and calls
        `attend`. Called at trace time; `window` is the layer's attention window."""
        return None

    def empty(self, lead: tuple[int, ...], n_kv_heads: int, head_dim: int) -> Records:
        """Zero-filled storage with leading axes `lead` (e.g. (B, S) or (N, block_size))."""
        return {name: jnp.zeros(lead + spec.shape, spec.dtype)
                for name, spec in self.record_spec(n_kv_heads, head_dim).items()}

    def check_finite(self, k, v) -> Array | None:
        """Per-row flag of K/V a lossy code cannot represent (None: nothing to flag)."""
        return None

    def describe(self) -> str:
        return type(self).__name__


@struct.dataclass
class FloatCodec(KVCodec):
    """K and V stored as they are, cast to `dtype` (float32, bfloat16 or float16)."""

    dtype: str = struct.field(pytree_node=False, default="float32")

    def __post_init__(self):
        if jnp.dtype(self.dtype) not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    def record_spec(self, n_kv_heads, head_dim):
        spec = jax.ShapeDtypeStruct((n_kv_heads, head_dim), jnp.dtype(self.dtype))
        return {"k": spec, "v": spec}

    def encode(self, k, v, positions):
        return {"k": k.astype(self.dtype), "v": v.astype(self.dtype)}

    def decode(self, records, positions):
        return records["k"], records["v"]

    def page_reader(self, window, read):
        def reader(q, pages, table, lengths):
            return paged_decode_attention(q, pages["k"], pages["v"], table, lengths,
                                          window=window, **read._asdict())
        return reader

    def describe(self):
        return jnp.dtype(self.dtype).name


def as_codec(codec_or_dtype: "KVCodec | str") -> KVCodec:
    """A codec, or a float dtype name meaning `FloatCodec(dtype)`."""
    if isinstance(codec_or_dtype, KVCodec):
        return codec_or_dtype
    if isinstance(codec_or_dtype, str):
        return FloatCodec(codec_or_dtype)
    raise TypeError(f"codec must be a KVCodec or a float dtype name, got "
                    f"{type(codec_or_dtype).__name__}")
