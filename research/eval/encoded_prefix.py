"""Codec quality over an exactly computed long prefix: one model pass serves every codec.

Serving a long prompt through a KV codec prefills it in chunks, each chunk reading the
earlier ones through the codec (`research.eval.divergence` measures that, about 105-190 s
per 8k window per codec on 2 CPU cores). Here a window's first P tokens run once through
the model with exact attention (f32, causal, in query blocks so no [P, P] matrix exists),
keeping each layer's input; a codec's cache is then filled by projecting those inputs to
K/V with the codec model's own weights (a codec may fold scales into W_k / W_v, as TaSQ
does) and writing them through the layer cache's own `update_and_attend` (its attention
output is unused). Only the rest of the window (a scored continuation, or a passkey
question and its answer) runs through the codec's read. This is the protocol of
KV-quantization papers that compress a prompt's cache after its prefill. It spares the
codec the compounding of serving: the prefix's K/V at layer l come from hidden states no
codec touched, so it isolates what reading a long compressed context costs. It is not a
bound on the served number: on 2 windows at 8k (results/serving_frontier_small against
results/serving_long_context_quality_8k) its KLs came within 15% of the served
protocol's, four codecs below and one (tasq-1bit-post+w128, 0.123 vs 0.120) above. A
codec model must compute the same residual stream as the model the prefix ran through
(only W_q, W_k, W_v, W_o may differ: `encoded_states` checks).

Every layer runs through one compiled one-layer program (`layer_view`: all layers share
shapes), so a codec costs a few small compiles, not a 30-layer one.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from research.core import attention
from research.kv.base import KVCache
from research.model import layers, llama
from research.model.llama import Model
from research.patchkv.layerwise import embed, layer_view


@struct.dataclass
class ExactChunkCache(KVCache):
    """A stateless cache for one chunk that starts at position 0 and is the whole
    sequence: exact causal attention over the chunk's own K/V, `block` queries at a time
    (each block reads only the keys up to its end)."""

    block: int = struct.field(pytree_node=False, default=512)

    def init(self, batch, max_len, n_kv_heads, head_dim):
        return {}

    def update_and_attend(self, state, q, k, v, *, start, n_new, window):
        del start, n_new  # `exact_prefix` runs it at start 0, every token real
        b, t = q.shape[:2]
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        valid = jnp.ones((b, t), bool)
        outs = []
        for lo in range(0, t, self.block):
            hi = min(lo + self.block, t)
            outs.append(attention.attend(q[:, lo:hi], k[:, :hi], v[:, :hi], pos[:, lo:hi],
                                         pos[:, :hi], valid[:, :hi], window))
        return jnp.concatenate(outs, axis=1), state


def _run_block(view: Model, x, start, n_new, state):
    t = x.shape[1]
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = jnp.arange(t)[None, :] < n_new[:, None]
    out = llama.decoder_block(view, 0, x, positions, valid, state, start, n_new)
    return out.x, out.cache_state


_layer = jax.jit(_run_block, donate_argnums=4)


@jax.jit
def _write(view: Model, state, x):
    """`state` with the K/V of layer inputs x [B, P, D] at positions 0..P-1 written by the
    layer's cache (K/V projected with the view's weights)."""
    b, p = x.shape[:2]
    c, params = view.config, view.params["layers"][0]
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    h = layers.rms_norm(x, params["attn_norm"], c.norm_eps)
    q, _, k, v = llama.project_qkv(c, params, h, positions)
    _, state = view.caches[0].update_and_attend(
        state, q, k, v, start=jnp.zeros((b,), jnp.int32),
        n_new=jnp.full((b,), p, jnp.int32), window=c.window(0))
    return state


@jax.jit
def _unembed(model: Model, x):
    return llama.unembed(model, x)


def _views(model: Model) -> list[Model]:
    return [layer_view(model, i) for i in range(model.config.n_layers)]


class ExactPrefix(NamedTuple):
    model: Model  # the model the prefix ran through
    inputs: list  # per layer: its input residual stream [B, P, D]


def exact_prefix(model: Model, tokens, *, block: int = 512) -> ExactPrefix:
    """Every layer's input for `tokens` [B, P] (all real, from position 0) computed with
    exact attention (module docstring)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] < 1:
        raise ValueError(f"tokens must be [batch, P >= 1] token ids, got {tokens.shape}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    b, p = tokens.shape
    exact = model.replace(caches=(ExactChunkCache(block),) * model.config.n_layers)
    x = embed(model, tokens)
    start, n_new = jnp.zeros((b,), jnp.int32), jnp.full((b,), p, jnp.int32)
    inputs = []
    for view in _views(exact):
        inputs.append(x)
        x, _ = _layer(view, x, start, n_new, {})
    return ExactPrefix(model, inputs)


_SAME_STREAM = ("attn_norm", "ffn_norm", "w_gate", "w_up", "w_down")  # + embed, final_norm


def check_same_stream(model: Model, other: Model) -> None:
    """Raise unless `other` computes `model`'s residual stream (only the attention
    projections may differ, e.g. TaSQ's folded K/V scales)."""
    pairs = [("embed", model.params["embed"], other.params["embed"]),
             ("final_norm", model.params["final_norm"], other.params["final_norm"])]
    for i, (p, q) in enumerate(zip(model.params["layers"], other.params["layers"])):
        pairs += [(f"layers[{i}].{k}", p[k], q[k]) for k in _SAME_STREAM if k in p]
    for name, a, b in pairs:
        if a is not b and not np.array_equal(np.asarray(a), np.asarray(b)):
            raise ValueError(f"the codec model's {name} differs from the prefix model's: "
                             "its hidden states would not be the prefix's")


def encoded_states(model: Model, prefix: ExactPrefix, max_len: int) -> tuple:
    """`model`'s cache states for max_len tokens holding the prefix's K/V, each layer's
    projected with `model`'s weights and written by that layer's cache."""
    check_same_stream(prefix.model, model)
    b, p = prefix.inputs[0].shape[:2]
    if max_len <= p:
        raise ValueError(f"max_len must exceed the prefix's {p} tokens, got {max_len}")
    states = model.init_cache(b, max_len)
    return tuple(_write(view, s, x)
                 for view, s, x in zip(_views(model), states, prefix.inputs))


def run_tokens(model: Model, states: tuple, tokens, start: int):
    """(logits [B, T, V] f32, new states) of `tokens` [B, T] at positions start..start+T-1
    read through `model`'s caches `states` (donated)."""
    tokens = np.asarray(tokens)
    b, t = tokens.shape
    x = embed(model, tokens)
    s0, n_new = jnp.full((b,), start, jnp.int32), jnp.full((b,), t, jnp.int32)
    new = []
    for view, state in zip(_views(model), states):
        x, state = _layer(view, x, s0, n_new, state)
        new.append(state)
    return _unembed(model, x), tuple(new)


def greedy_tokens(model: Model, states: tuple, tail, start: int, max_new_tokens: int
                  ) -> np.ndarray:
    """[B, max_new_tokens] greedy tokens after the prompt tail `tail` [B, T] (at positions
    start..) read through `states` (donated)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    logits, states = run_tokens(model, states, tail, start)
    pos = start + np.asarray(tail).shape[1]
    out = [np.asarray(jnp.argmax(logits[:, -1], -1))]
    for _ in range(max_new_tokens - 1):
        logits, states = run_tokens(model, states, out[-1][:, None], pos)
        pos += 1
        out.append(np.asarray(jnp.argmax(logits[:, -1], -1)))
    return np.stack(out, axis=1)
