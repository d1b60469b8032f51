"""The transform protocol: how a technique plugs into servax.

A technique is a `Transform`, a NamedTuple of two pure functions (optax style):

    calibrate(model, data) -> state     # look at the model on calibration data
    apply(model, state)    -> model     # return a new Model (params, caches, ...)

`state` is a pytree (codebooks, patches, plans), so it can be saved with orbax and
re-applied without recalibrating. `chain(a, b)` calibrates `b` on the model `a` produced:
`chain(tasq(bits=1), patchkv(budget=0.1))` quantizes the KV cache, then fits a patch
that compensates what quantization lost.
"""
from __future__ import annotations


import jax.numpy as jnp

from research.core.transform import (CalibrationData, State, Transform,  # noqa: F401
                                     calibrate_and_apply, chain, frozen,
                                     identity)
from research.kv.codec import FloatCodec
from research.kv.layouts import replace_codecs
from research.model.llama import Model


def kv_cache_dtype(dtype: str = "bfloat16") -> Transform:
    """Store every layer's K/V as floats of `dtype`, in whatever layout it has (no
    calibration). Refuses to discard another transform's codec."""
    codec = FloatCodec(dtype)  # validates the dtype now, not at first use

    def apply(model: Model, state) -> Model:
        return replace_codecs(model, lambda i: codec, f"kv_cache_dtype({dtype})",
                              f"kv-{dtype}", replace_any_float=True)

    return Transform(lambda model, data: (), apply, f"kv_cache_dtype({dtype})")


def weights_dtype(dtype: str = "bfloat16") -> Transform:
    """Cast all params to `dtype` (activations follow; norms and softmax stay f32)."""
    jnp.dtype(dtype)
    return Transform(lambda model, data: (), lambda model, state: model.astype(dtype),
                     f"weights_dtype({dtype})")
