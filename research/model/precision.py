"""Precision transforms: the dtype of a model's weights and of its KV cache's float codec.

They live with the model rather than in research/transforms.py because they import the
caches (research.kv), which themselves build transforms: the protocol module stays a leaf.
"""
from __future__ import annotations

import jax.numpy as jnp

from research.kv.codec import FloatCodec
from research.kv.layouts import replace_codecs
from research.model.llama import Model
from research.transforms import Transform, stateless


def kv_cache_dtype(dtype: str = "bfloat16") -> Transform:
    """Store every layer's K/V as floats of `dtype`, in whatever layout it has (no
    calibration). Refuses to discard another transform's codec."""
    codec = FloatCodec(dtype)  # validates the dtype now, not at first use

    def apply(model: Model, state) -> Model:
        return replace_codecs(model, lambda i: codec, f"kv_cache_dtype({dtype})",
                              f"kv-{dtype}", replace_any_float=True)

    return stateless(apply, f"kv_cache_dtype({dtype})")


def weights_dtype(dtype: str = "bfloat16") -> Transform:
    """Cast all params to `dtype` (activations follow; norms and softmax stay f32)."""
    jnp.dtype(dtype)
    return stateless(lambda model, state: model.astype(dtype), f"weights_dtype({dtype})")
