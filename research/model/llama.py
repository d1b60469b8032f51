"""Llama-family decoder as pure functions over a params pytree.

Params layout (weights are [in, out] so activations multiply on the left):

    {"embed": [V, D], "final_norm": [D], ("lm_head": [D, V] when not tied),
     "layers": ({"attn_norm": [D], "wq": [D, Hq*Dh], "wk": [D, Hkv*Dh], "wv": [D, Hkv*Dh],
                 "wo": [Hq*Dh, D], "ffn_norm": [D],
                 dense FFN: "w_gate": [D, F], "w_up": [D, F], "w_down": [F, D]
                 MoE FFN:   "router": [D, E], "w_gate": [E, D, F'], "w_up": [E, D, F'],
                            "w_down": [E, F', D]}, ...)}

A `Model` bundles config (static), params and one `KVCache` per layer; transforms return
new Models. `forward` runs a chunk of tokens either without a cache (training, calibration)
or through the per-layer caches (prefill and decode).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from research.kv.base import KVCache
from research.kv.codec import FloatCodec
from research.kv.dense import DenseKVCache
from research.kv.window import WindowKVCache
from research.core import attention
from research.model import layers
from research.model.config import ModelConfig
from flax import struct


@struct.dataclass
class Model:
    config: ModelConfig = struct.field(pytree_node=False)
    params: Any
    caches: tuple  # one KVCache per layer
    # Free-form static tags transforms may leave (e.g. "tasq"), for reporting only.
    tags: tuple = struct.field(pytree_node=False, default=())

    def replace(self, **changes) -> "Model":
        return dataclasses.replace(self, **changes)

    def astype(self, dtype) -> "Model":
        """Floating params cast to `dtype` (compute runs in this dtype; norms/softmax stay
        f32). Integer arrays (quantized weight codes) keep their dtype."""
        params = jax.tree.map(
            lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
            self.params)
        return self.replace(params=params)

    def for_phase(self, phase: str) -> "Model":
        """The model serving `phase` ("prefill" or "decode"): every weight that holds one
        set per phase (a `layers.LinearWeight`, e.g. `research.dynacore`'s) is replaced by
        that phase's set. A model without such weights returns itself (same params)."""
        if phase not in ("prefill", "decode"):
            raise ValueError(f"phase must be 'prefill' or 'decode', got {phase!r}")
        is_w = lambda x: isinstance(x, layers.LinearWeight)  # noqa: E731
        if not any(is_w(x) for x in jax.tree.leaves(self.params, is_leaf=is_w)):
            return self
        params = jax.tree.map(lambda x: x.for_phase(phase) if is_w(x) else x, self.params,
                              is_leaf=is_w)
        return self.replace(params=params)

    @property
    def prefill_model(self) -> "Model":
        """The view prefill runs (writes the KV cache); see `for_phase`."""
        return self.for_phase("prefill")

    @property
    def decode_model(self) -> "Model":
        """The view decode runs (continues from the prefilled cache); see `for_phase`."""
        return self.for_phase("decode")

    @property
    def dtype(self):
        return self.params["embed"].dtype

    def init_cache(self, batch: int, max_len: int) -> tuple:
        """Per-layer cache states for `batch` sequences of up to `max_len` tokens."""
        if batch < 1 or max_len < 1:
            raise ValueError(f"batch and max_len must be >= 1, got {batch=}, {max_len=}")
        c = self.config
        return tuple(cache.init(batch, max_len, c.n_kv_heads, c.head_dim)
                     for cache in self.caches)

    def leading_slots(self, cache_states: tuple, n: int) -> tuple | None:
        """Every layer's state cut to its first `n` token slots (`KVCache.leading_slots`),
        or None if a layer's layout cannot cut its state or `n` covers it all."""
        cut = tuple(c.leading_slots(s, n) for c, s in zip(self.caches, cache_states))
        return None if any(x is None for x in cut) else cut

    def with_leading_slots(self, cache_states: tuple, parts: tuple) -> tuple:
        """`cache_states` with their first slots replaced by `parts` (`leading_slots`)."""
        return tuple(c.with_leading_slots(s, p)
                     for c, s, p in zip(self.caches, cache_states, parts))

    def live_slots(self, cache_states: tuple, end: int, chunk: int) -> int | None:
        """Slots a prefill piece ending at token `end` attends over: `chunk` times the next
        power of two >= end / chunk (few compiled shapes), or None (the whole state:
        `leading_slots` cannot cut it to that). Key blocks past it are masked for every
        row of the piece, so skipping them changes nothing but the cost."""
        live = chunk * (1 << max(0, -(-end // chunk) - 1).bit_length())
        cut = jax.eval_shape(lambda: self.leading_slots(cache_states, live))
        return None if cut is None else live


def default_caches(config: ModelConfig, dtype: str = "float32") -> tuple[KVCache, ...]:
    """Dense caches for global layers, window rings for sliding layers."""
    codec = FloatCodec(dtype)
    return tuple(WindowKVCache(window=config.window(i), codec=codec)
                 if config.window(i) else DenseKVCache(codec)
                 for i in range(config.n_layers))


def make_model(config: ModelConfig, params, kv_dtype: str = "float32") -> Model:
    return Model(config=config, params=params, caches=default_caches(config, kv_dtype))


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random params (scaled normal) with the layout above, for tests and training."""
    c = config
    keys = iter(jax.random.split(key, 4 + 8 * c.n_layers))

    def dense(shape, fan_in):
        return (jax.random.normal(next(keys), shape) / np.sqrt(fan_in)).astype(dtype)

    layers_p = []
    for i in range(c.n_layers):
        p = {"attn_norm": jnp.ones((c.dim,), dtype), "ffn_norm": jnp.ones((c.dim,), dtype),
             "wq": dense((c.dim, c.n_heads * c.head_dim), c.dim),
             "wk": dense((c.dim, c.n_kv_heads * c.head_dim), c.dim),
             "wv": dense((c.dim, c.n_kv_heads * c.head_dim), c.dim),
             "wo": dense((c.n_heads * c.head_dim, c.dim), c.n_heads * c.head_dim)}
        if c.is_moe(i):
            e, f = c.moe.n_experts, c.moe.expert_ffn_dim
            p.update(router=dense((c.dim, e), c.dim), w_gate=dense((e, c.dim, f), c.dim),
                     w_up=dense((e, c.dim, f), c.dim), w_down=dense((e, f, c.dim), f))
        else:
            p.update(w_gate=dense((c.dim, c.ffn_dim), c.dim),
                     w_up=dense((c.dim, c.ffn_dim), c.dim),
                     w_down=dense((c.ffn_dim, c.dim), c.ffn_dim))
        layers_p.append(p)
    params = {"embed": dense((c.vocab_size, c.dim), c.dim),
              "final_norm": jnp.ones((c.dim,), dtype), "layers": tuple(layers_p)}
    if not c.tie_embeddings:
        params["lm_head"] = dense((c.dim, c.vocab_size), c.dim)
    return params


class ForwardOutput(NamedTuple):
    logits: Array  # [B, T, V] or [B, V] when logits="last"
    cache_states: tuple | None
    captures: tuple | None  # per layer dict of activations when capture=True
    routing: tuple | None  # per MoE layer Routing, else None entries
    # [B] int32 when check_finite=True: per row, the first layer whose K/V or block output
    # holds a NaN/inf at a real (non-padding) token; -1 when every layer stayed finite.
    nonfinite_layer: Array | None = None


class BlockOutput(NamedTuple):
    x: Array  # [B, T, D] residual stream after the layer
    cache_state: Any  # the layer's new cache state (None without a cache)
    captured: dict | None  # {"h","q","k_pre","k","v","attn"} when capture=True
    routing: Any  # Routing of an MoE layer, else None
    nonfinite: Array | None  # [B] bool when check_finite=True: NaN/inf in K/V or output


def project_qkv(c: ModelConfig, p: dict, h: Array, positions: Array):
    """(q, k before RoPE, k, v) of the normed residual `h` at `positions` [B, T].

    A public hook: code that writes a layer's K/V without running its attention (e.g.
    `research.eval.encoded_prefix`) calls this to stay identical to `forward`."""
    b, t, _ = h.shape
    q = layers.linear(h, p["wq"]).reshape(b, t, c.n_heads, c.head_dim)
    k_pre = layers.linear(h, p["wk"]).reshape(b, t, c.n_kv_heads, c.head_dim)
    v = layers.linear(h, p["wv"]).reshape(b, t, c.n_kv_heads, c.head_dim)
    q = layers.apply_rope(q, positions, c.rope_theta)
    k = layers.apply_rope(k_pre, positions, c.rope_theta)
    return q, k_pre, k, v


def feed_forward(config: ModelConfig, layer: int, p: dict, h: Float[Array, "B T D"]):
    """Layer `layer`'s FFN on the normed residual `h` (dense SwiGLU, or the MoE FFN with
    `config.moe.ffn` when set): returns (y [B, T, D], Routing or None).

    A public hook: code that re-runs part of a layer (e.g. PatchKV's layer-wise fitting,
    `research.patchkv.layerwise`) calls this to stay identical to `forward`."""
    c = config
    if not c.is_moe(layer):
        return layers.swiglu(h, p["w_gate"], p["w_up"], p["w_down"]), None
    b, t, d = h.shape
    moe_ffn = c.moe.ffn or layers.moe_ffn
    y, routing = moe_ffn(h.reshape(b * t, d), p, c.moe.top_k, c.moe.renormalize)
    return y.reshape(b, t, d), routing


def _nonfinite_rows(a: Array, valid: Bool[Array, "B T"]) -> Bool[Array, "B"]:
    """Rows with a NaN/inf anywhere in `a` [B, T, ...] at a real token."""
    bad = ~jnp.isfinite(a).reshape(a.shape[0], a.shape[1], -1).all(-1)
    return (bad & valid).any(-1)


def decoder_block(model: Model, layer: int, x: Float[Array, "B T D"],
                  positions: Int[Array, "B T"], valid: Bool[Array, "B T"], cache_state,
                  start: Int[Array, "B"] | None, n_new: Int[Array, "B"] | None,
                  capture: bool = False, check_finite: bool = False) -> BlockOutput:
    """One decoder layer (pre-norm attention + FFN, residuals) as `forward` runs it.

    positions: absolute position of every token; valid: real (non-padding) tokens.
    cache_state: the layer's cache state (K/V written at start[b] + t for t < n_new[b],
      attention read through `model.caches[layer]`), or None for cache-free causal
      attention over the chunk alone (start / n_new unused then).
    capture: also return the layer's activations; check_finite: also return which rows
      have a NaN/inf in this layer's K/V or output at a real token.

    A public hook: code that runs a model one layer at a time (e.g. PatchKV's layer-wise
    fitting over a one-layer view of the model, `research.patchkv.layerwise`) calls this
    so it stays identical to `forward`.
    """
    c, p = model.config, model.params["layers"][layer]
    h = layers.rms_norm(x, p["attn_norm"], c.norm_eps)
    q, k_pre, k, v = project_qkv(c, p, h, positions)
    window = c.window(layer)
    if cache_state is None:
        attn = attention.attend(q, k, v, positions, positions, valid, window)
    else:
        attn, cache_state = model.caches[layer].update_and_attend(
            cache_state, q, k, v, start=start, n_new=n_new, window=window)
    b, t = x.shape[:2]
    attn_flat = attn.reshape(b, t, c.n_heads * c.head_dim)
    x = x + layers.linear(attn_flat, p["wo"])
    h2 = layers.rms_norm(x, p["ffn_norm"], c.norm_eps)
    ffn_out, routing = feed_forward(c, layer, p, h2)
    x = x + ffn_out
    captured = None
    if capture:
        captured = {"h": h, "q": q, "k_pre": k_pre, "k": k, "v": v, "attn": attn_flat}
    nonfinite = None
    if check_finite:
        nonfinite = (_nonfinite_rows(k, valid) | _nonfinite_rows(v, valid)
                     | _nonfinite_rows(x, valid))
    return BlockOutput(x, cache_state, captured, routing, nonfinite)


def unembed(model: Model, h: Array) -> Array:
    """Final norm + LM head; logits in f32."""
    p = model.params
    h = layers.rms_norm(h, p["final_norm"], model.config.norm_eps)
    if model.config.tie_embeddings:
        return (h @ p["embed"].T).astype(jnp.float32)
    return layers.linear(h, p["lm_head"]).astype(jnp.float32)


def forward_live(model: Model, tokens: Int[Array, "B T"], *, cache_states: tuple,
                 live: int | None, **kwargs) -> ForwardOutput:
    """`forward` attending over the first `live` slots of every layer's state only (from
    `Model.live_slots`; None: the whole state): the states are cut to those slots, the
    chunk runs, and the returned states are the whole ones with those slots updated."""
    if live is None:
        return forward(model, tokens, cache_states=cache_states, **kwargs)
    out = forward(model, tokens, cache_states=model.leading_slots(cache_states, live),
                  **kwargs)
    return out._replace(cache_states=model.with_leading_slots(cache_states,
                                                              out.cache_states))


def forward(model: Model, tokens: Int[Array, "B T"], *, cache_states: tuple | None = None,
            start: Int[Array, "B"] | None = None, n_new: Int[Array, "B"] | None = None,
            logits: str = "all", capture: bool = False,
            check_finite: bool = False) -> ForwardOutput:
    """Run a chunk of tokens.

    tokens: [B, T] int32, right-padded; row b's real tokens are tokens[b, :n_new[b]] at
      absolute positions start[b] + t (start defaults to 0, n_new to T).
    cache_states: per-layer states from `model.init_cache`, or None for cache-free
      causal attention over the chunk alone.
    logits: "all" -> [B, T, V]; "last" -> [B, V] at each row's last real token; "none".
    capture: also return per-layer activations (for calibrating transforms).
    check_finite: also return `nonfinite_layer` [B]: per row the first layer whose K/V or
      output holds a NaN/inf at a real token, -1 if none (a few reductions per layer).
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, time], got {tokens.shape=}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be integer token ids, got {tokens.dtype=}")
    if logits not in ("all", "last", "none"):
        raise ValueError(f"logits must be 'all', 'last' or 'none', got {logits!r}")
    b, t = tokens.shape
    start = jnp.zeros((b,), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
    n_new = jnp.full((b,), t, jnp.int32) if n_new is None else jnp.asarray(n_new, jnp.int32)
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = jnp.arange(t)[None, :] < n_new[:, None]
    x = model.params["embed"][tokens]
    new_states, captures, routings, nonfinite = [], [], [], []
    for layer in range(model.config.n_layers):
        state = None if cache_states is None else cache_states[layer]
        x, state, cap, routing, bad = decoder_block(model, layer, x, positions, valid, state,
                                                    start, n_new, capture, check_finite)
        new_states.append(state)
        captures.append(cap)
        routings.append(routing)
        nonfinite.append(bad)
    if logits == "all":
        out = unembed(model, x)
    elif logits == "last":
        last = jnp.maximum(n_new - 1, 0)
        # take_along_axis (a batched gather), not x[arange(b), last]: under a batch-sharded
        # mesh GSPMD keeps it local instead of all-gathering the hidden states
        out = unembed(model, jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0])
    else:
        out = None
    first_bad = None
    if check_finite:
        bad = jnp.stack(nonfinite)  # [L, B]
        first_bad = jnp.where(bad.any(0), jnp.argmax(bad, 0), -1).astype(jnp.int32)
    return ForwardOutput(out, None if cache_states is None else tuple(new_states),
                         tuple(captures) if capture else None, tuple(routings), first_bad)
