"""The layouts as one family: swap a layer's codec, keeping where its tokens live.

A codec transform (int8, TaSQ, CQ, sign-bit, bf16 storage) changes *how* K/V are encoded
and nothing else, so a model whose layers are dense, window rings or pages keeps them.
Replacing is only allowed over the raw float32 default: a codec another transform
installed, or a cache that is not a codec in a layout (an eviction press), is never
silently discarded; the transform refuses and names both. `kv_window` is the exception
that proves it: it wraps the installed codec (a bfloat16 sink + recent window over it,
research/kv/windowed.py) instead of replacing it (`wrap_codecs`, which the K-or-V ablation
of research/kv/exact_part.py uses too).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from research.kv.base import KVCache
from research.kv.codec import FloatCodec, KVCodec
from research.kv.dense import DenseKVCache
from research.kv.paged import PagedKVCache
from research.kv.window import WindowKVCache
from research.kv.windowed import WindowedCodec, check_window
from research.transforms import Transform, stateless

if TYPE_CHECKING:  # type-only: research.model depends on research.kv, not the reverse
    from research.model.llama import Model

LAYOUTS = (DenseKVCache, WindowKVCache, PagedKVCache)


def is_raw(cache: KVCache) -> bool:
    """A layout over the default float32 codec (nothing installed by a transform yet)."""
    return (isinstance(cache, LAYOUTS) and isinstance(cache.codec, FloatCodec)
            and cache.codec.dtype == "float32")


def with_codec(cache: KVCache, codec: KVCodec, who: str, layer: int,
               replace_any_float: bool = False) -> KVCache:
    """`cache` in the same layout with `codec`; refuses to discard another transform's
    codec or a non-layout cache, naming `who` (the transform) and what it would discard."""
    if not isinstance(cache, LAYOUTS):
        raise TypeError(f"{who} would discard layer {layer}'s {cache.describe()} cache: "
                        "codecs apply to dense, window and paged layouts only")
    keep_ok = is_raw(cache) or (replace_any_float and isinstance(cache.codec, FloatCodec))
    if not keep_ok:
        raise TypeError(f"{who} would discard layer {layer}'s {cache.codec.describe()} codec "
                        f"({cache.describe()}), installed by another transform; apply {who} "
                        "to the model before that transform, or not at all")
    return dataclasses.replace(cache, codec=codec)


def replace_codecs(model: "Model", make_codec: Callable[[int], KVCodec], who: str,
                   tag: str, replace_any_float: bool = False) -> "Model":
    """Every layer's codec replaced by `make_codec(layer)`, layouts kept."""
    caches = tuple(with_codec(cache, make_codec(i), who, i, replace_any_float)
                   for i, cache in enumerate(model.caches))
    return model.replace(caches=caches, tags=model.tags + (tag,))


def wrap_codecs(model: "Model", wrap: Callable[[KVCodec], KVCodec], who: str,
                tag: str) -> "Model":
    """Every layer's codec replaced by `wrap(codec)`, which keeps it inside (a window, an
    ablation), layouts kept; a cache that is not a codec in a layout is refused by name."""
    caches = []
    for i, cache in enumerate(model.caches):
        if not isinstance(cache, LAYOUTS):
            raise TypeError(f"{who} would discard layer {i}'s {cache.describe()} cache: it "
                            "wraps codecs in dense, window or paged layouts only")
        caches.append(dataclasses.replace(cache, codec=wrap(cache.codec)))
    return model.replace(caches=tuple(caches), tags=model.tags + (tag,))


def kv_window(sink: int = 4, recent: int = 128) -> Transform:
    """Transform: every layer's codec (whatever a transform installed before) keeps a
    bfloat16 copy read for the first `sink` and each query's last `recent` tokens."""
    check_window(sink, recent)

    def apply(model, state):
        del state
        return wrap_codecs(model, lambda codec: WindowedCodec(codec, sink, recent),
                           "kv_window", f"w{recent}")

    return stateless(apply, f"kv_window(sink={sink}, recent={recent})")
