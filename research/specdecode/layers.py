"""A model restricted to a subset of its layers: the self-speculative draft network.

The sub-model shares the target's embedding, final norm and LM head (early exit /
layer skipping, Draft & Verify, LayerSkip) and its KV caches are the target's caches of the
same layers, so it needs no weights or memory of its own.
"""
from __future__ import annotations

from typing import Sequence

from research.model.llama import Model


def validate_layers(n_layers: int, layers: Sequence[int]) -> tuple[int, ...]:
    """Sorted, unique, in-range layer ids, or a ValueError naming `layers`."""
    ids = tuple(int(i) for i in layers)
    if not ids:
        raise ValueError("layers is empty: the draft network needs at least one layer")
    if any(not 0 <= i < n_layers for i in ids):
        raise ValueError(f"layers {ids} must lie in [0, n_layers={n_layers})")
    if list(ids) != sorted(set(ids)):
        raise ValueError(f"layers must be strictly increasing without repeats, got {ids}")
    return ids


def layer_subset_model(model: Model, layers: Sequence[int]) -> Model:
    """`model` running only `layers` (in order), with the shared embedding and head.

    The result is a plain `Model`, so `forward` runs it; cache state i of the sub-model is
    cache state layers[i] of the target.
    """
    c = model.config
    ids = validate_layers(c.n_layers, layers)
    moe_layers = tuple(j for j, i in enumerate(ids) if c.is_moe(i))
    config = c.replace(
        n_layers=len(ids),
        layer_kinds=None if c.layer_kinds is None else tuple(c.layer_kinds[i] for i in ids),
        moe=c.moe if moe_layers else None, moe_layers=moe_layers or None)
    params = dict(model.params)
    params["layers"] = tuple(model.params["layers"][i] for i in ids)
    return model.replace(config=config, params=params,
                         caches=tuple(model.caches[i] for i in ids))


def take_states(states: tuple, layers: Sequence[int]) -> tuple:
    return tuple(states[i] for i in layers)


def put_states(states: tuple, layers: Sequence[int], sub_states: tuple) -> tuple:
    """`states` with entries `layers` replaced by `sub_states`."""
    out = list(states)
    for i, s in zip(layers, sub_states):
        out[i] = s
    return tuple(out)
