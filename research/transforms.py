"""The transform protocol: how a technique plugs into servax.

A technique is a `Transform`, a NamedTuple of two pure functions (optax style):

    calibrate(model, data) -> state     # look at the model on calibration data
    apply(model, state)    -> model     # return a new Model (params, caches, ...)

`state` is a pytree (codebooks, patches, plans), so it can be saved with orbax and
re-applied without recalibrating. `chain(a, b)` calibrates `b` on the model `a` produced:
`chain(evict("snapkv", 0.1), patchkv())` (`research.eviction.evict`,
`research.patchkv.patch.patchkv`) keeps 10% of the context's KV per head, then fits a
ridge weight patch that compensates what eviction lost.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from research.core.transform import (CalibrationData, State, Transform,  # noqa: F401
                                     calibrate_and_apply, chain, frozen,
                                     identity)
from research.kv.dense import DenseKVCache
from research.kv.window import WindowKVCache
from research.model.llama import Model


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

    return Transform(lambda model, data: (), apply, f"kv_cache_dtype({dtype})")


def weights_dtype(dtype: str = "bfloat16") -> Transform:
    """Cast all params to `dtype` (activations follow; norms and softmax stay f32)."""
    jnp.dtype(dtype)
    return Transform(lambda model, data: (), lambda model, state: model.astype(dtype),
                     f"weights_dtype({dtype})")
