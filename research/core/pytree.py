"""Frozen dataclasses that are JAX pytrees: array fields are leaves, static fields metadata.

Static fields (hyper-parameters, dtypes, configs) must be hashable: they become part of
the `jit` cache key.
"""
from __future__ import annotations

import dataclasses

import jax


def static_field(**kwargs):
    """A dataclass field stored in pytree metadata (not traced)."""
    return dataclasses.field(metadata={"static": True}, **kwargs)


def pytree_dataclass(cls):
    """Decorator: frozen dataclass + `jax.tree_util.register_dataclass`."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    meta = [f.name for f in fields if f.metadata.get("static", False)]
    data = [f.name for f in fields if not f.metadata.get("static", False)]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)
