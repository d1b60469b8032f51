"""Run token rows through a model one decoder layer at a time, over given cache states.

Fitting layer l's patch on the model that layers < l already patched needs the hidden
states between layers; `layer_view(model, l)` is a one-layer Model sharing layer l's
params and cache, so every layer runs through the same compiled program (the model's own
public block, `research.model.llama.decoder_block`, unchanged).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from research.model import layers, llama
from research.model.llama import Model
from research.patchkv.session import tile_states


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


@jax.jit
def run_layer(view: Model, x: Float[Array, "B T D"], start: Int[Array, "B"],
              n_new: Int[Array, "B"], state) -> tuple[Array, dict]:
    """(hidden after the layer, captures {"h","q","k_pre","k","v","attn"}) for `x` at
    positions start[b] + t over one layer's cache `state` (the returned state is dropped:
    each call sees the same prefilled context)."""
    t = x.shape[1]
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = jnp.arange(t)[None, :] < n_new[:, None]
    out = llama.decoder_block(view, 0, x, positions, valid, state, start, n_new, capture=True)
    return out.x, out.captured


ROW_CHUNK = 16  # probe rows per call: the per-row cache copies of a long context stay small


def run_layer_rows(view: Model, x, start, n_new, state, context_of,
                   chunk: int = ROW_CHUNK) -> tuple[Array, dict]:
    """`run_layer` over rows x [P, T, D] whose caches are batch rows `context_of` [P] of
    one layer's `state`, `chunk` rows at a time (each chunk gathers only its rows' caches:
    with a long context, all P copies at once take P times the cache). Same outputs as
    one call on the gathered states."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    context_of = jnp.asarray(context_of, jnp.int32)
    outs, caps = [], []
    for i in range(0, x.shape[0], chunk):
        rows = slice(i, i + chunk)
        s = tile_states((state,), context_of[rows])[0]
        out, cap = run_layer(view, x[rows], start[rows], n_new[rows], s)
        outs.append(out)
        caps.append(cap)
    return (jnp.concatenate(outs), {k: jnp.concatenate([c[k] for c in caps])
                                    for k in caps[0]})


def embed(model: Model, tokens) -> Array:
    return model.params["embed"][jnp.asarray(tokens, jnp.int32)]


@jax.jit
def ffn_hidden(view: Model, x: Float[Array, "B T D"]) -> Array:
    """The dense FFN's hidden activations silu(h W_gate) * (h W_up) [B, T, F], h =
    ffn_norm(x), for the residual stream x after attention: what W_down reads (mirrors
    `layers.swiglu`; a test checks x + ffn_hidden(x) @ W_down against `finish_layer`)."""
    c, p = view.config, view.params["layers"][0]
    if c.is_moe(0):
        raise ValueError("ffn_hidden needs a dense FFN layer, got an MoE layer")
    h2 = layers.rms_norm(x, p["ffn_norm"], c.norm_eps)
    return jax.nn.silu(h2 @ p["w_gate"]) * (h2 @ p["w_up"])


@jax.jit
def finish_layer(view: Model, x: Float[Array, "B T D"], attn: Float[Array, "B T HD"],
                 wo: Float[Array, "HD D"]) -> Array:
    """The rest of the block after attention, with output projection `wo`: what
    `run_layer` returns for the same x and attention output, without recomputing
    attention (mirrors `llama.decoder_block`; a test checks they agree)."""
    c, p = view.config, view.params["layers"][0]
    x = x + attn @ wo.astype(x.dtype)
    h2 = layers.rms_norm(x, p["ffn_norm"], c.norm_eps)
    ffn_out, _ = llama.feed_forward(c, 0, p, h2)
    return x + ffn_out
