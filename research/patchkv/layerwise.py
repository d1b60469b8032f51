"""Run token rows through a model one decoder layer at a time, over given cache states.

Fitting layer l's patch on the model that layers < l already patched needs the hidden
states between layers; `layer_view(model, l)` is a one-layer Model sharing layer l's
params and cache, so every layer runs through the same compiled program (the core block,
`research.model.llama._block`, unchanged).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from research.model import llama
from research.model.llama import Model


def layer_view(model: Model, layer: int, layer_params: dict | None = None) -> Model:
    """A one-layer Model: layer `layer`'s params (or `layer_params`) and cache."""
    c = model.config
    if not 0 <= layer < c.n_layers:
        raise ValueError(f"layer must be in [0, {c.n_layers}), got {layer}")
    config = c.replace(
        n_layers=1, layer_kinds=None if c.layer_kinds is None else (c.kind(layer),),
        moe_layers=None if c.moe is None else ((0,) if c.is_moe(layer) else ()))
    params = {"layers": (model.params["layers"][layer] if layer_params is None
                         else layer_params,)}
    return Model(config=config, params=params, caches=(model.caches[layer],))


@functools.partial(jax.jit, static_argnames=())
def run_layer(view: Model, x: Float[Array, "B T D"], start: Int[Array, "B"],
              n_new: Int[Array, "B"], state) -> tuple[Array, dict]:
    """(hidden after the layer, captures {"h","q","k_pre","k","v","attn"}) for `x` at
    positions start[b] + t over one layer's cache `state` (the returned state is dropped:
    each call sees the same prefilled context)."""
    t = x.shape[1]
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = jnp.arange(t)[None, :] < n_new[:, None]
    x_out, _, captured, _ = llama._block(view, 0, x, positions, valid, state, start, n_new,
                                         True)
    return x_out, captured


def embed(model: Model, tokens) -> Array:
    return model.params["embed"][jnp.asarray(tokens, jnp.int32)]
