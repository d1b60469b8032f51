"""Precision transforms: the dtype of a model's weights and of its dense / window KV caches.

They live with the model rather than in research/transforms.py because they import the
caches (research.kv), which themselves build transforms: the protocol module stays a leaf.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from research.kv.dense import DenseKVCache
from research.kv.window import WindowKVCache
from research.model.llama import Model
from research.transforms import Transform, stateless


def kv_cache_dtype(dtype: str = "bfloat16") -> Transform:
    """Store the KV cache of every dense / window layer in `dtype` (no calibration)."""
    DenseKVCache(dtype=dtype)  # validates the dtype now, not at first use

    def apply(model: Model, state) -> Model:
        caches = []
        for i, cache in enumerate(model.caches):
            if not isinstance(cache, (DenseKVCache, WindowKVCache)):
                raise TypeError(f"kv_cache_dtype: layer {i} has a {cache.describe()} cache; "
                                "it applies to dense and window caches only")
            caches.append(dataclasses.replace(cache, dtype=dtype))
        return model.replace(caches=tuple(caches), tags=model.tags + (f"kv-{dtype}",))

    return stateless(apply, f"kv_cache_dtype({dtype})")


def weights_dtype(dtype: str = "bfloat16") -> Transform:
    """Cast all params to `dtype` (activations follow; norms and softmax stay f32)."""
    jnp.dtype(dtype)
    return stateless(lambda model, state: model.astype(dtype), f"weights_dtype({dtype})")
