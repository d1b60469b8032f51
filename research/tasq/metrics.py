"""Measurements shared by the experiment, notebook and tests: cache bytes, bits per
channel, attention-output error of a cache codec."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from research.kv import memory
from research.model.llama import Model, default_caches, forward


def cache_param_bytes(model: Model) -> int:
    """Bytes of the cache objects' own arrays (codebooks, permutations, projections): fixed
    per model, not per token, so `memory.kv_cache_bytes` (state arrays) does not see them."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(model.caches))


def bits_per_channel(model: Model, context: int) -> float:
    """Cache-state bits per K or V channel per token, every per-token/per-block overhead
    included (scales, rings amortised over `context`); codebooks are reported separately."""
    c = model.config
    return memory.kv_bytes_per_token(model, context) * 8 / (2 * c.n_layers * c.n_kv_heads *
                                                             c.head_dim)


def max_batch_with_codebooks(model: Model, budget_bytes: int, context: int) -> int:
    """memory.max_batch after the fixed cache arrays (codebooks) are taken from the budget."""
    return memory.max_batch(model, budget_bytes - cache_param_bytes(model), context)


@jax.jit
def _exact_captures(model: Model, tokens, lengths):
    """Cache-free forward (exact attention); `model` comes with default caches so every
    codec variant of the same params shares one compilation."""
    out = forward(model, tokens, n_new=lengths, logits="none", capture=True)
    return tuple({k: c[k] for k in ("q", "k", "v", "attn")} for c in out.captures)


@functools.partial(jax.jit, static_argnames=("window",))
def _codec_error(cache, wo, q, k, v, attn, lengths, window):
    """|(codec_out - exact_out) W_o|^2 and |exact_out W_o|^2 over real tokens (one layer)."""
    b, t, hkv, d = k.shape
    state = cache.init(b, t, hkv, d)
    approx, _ = cache.update_and_attend(state, q, k, v, start=jnp.zeros((b,), jnp.int32),
                                        n_new=lengths, window=window)
    wo = wo.astype(jnp.float32)
    exact = attn.astype(jnp.float32) @ wo
    diff = approx.reshape(b, t, -1).astype(jnp.float32) @ wo - exact
    valid = (jnp.arange(t)[None, :] < lengths[:, None])[..., None]
    return (jnp.sum(jnp.where(valid, diff * diff, 0.0)),
            jnp.sum(jnp.where(valid, exact * exact, 0.0)))


def _layer_errors(model: Model, tokens, lengths):
    c = model.config
    caps = _exact_captures(model.replace(caches=default_caches(c)), tokens, lengths)
    errs, norms = [], []
    for layer, cap in enumerate(caps):
        e, n = _codec_error(model.caches[layer], model.params["layers"][layer]["wo"],
                            cap["q"], cap["k"], cap["v"], cap["attn"], lengths,
                            c.window(layer))
        errs.append(e)
        norms.append(n)
    return jnp.stack(errs), jnp.stack(norms)


def attention_output_error(model: Model, tokens, lengths=None, batch_size: int = 4) -> dict:
    """Relative error of each layer's attention output (after W_o, so folded scales do not
    change it) when its K/V go through the model's cache codec instead of exact f32.

    Each layer is fed the exact q/k/v of the cache-free forward: this isolates one codec
    application from error compounding across layers (perplexity shows the compounded
    effect). Returns {"mean": float, "per_layer": [L]}.
    """
    tokens = np.asarray(tokens, np.int32)
    lengths = np.full((len(tokens),), tokens.shape[1], np.int32) if lengths is None else \
        np.asarray(lengths, np.int32)
    err = norm = 0.0
    for i in range(0, len(tokens), batch_size):
        e, n = _layer_errors(model, jnp.asarray(tokens[i:i + batch_size]),
                             jnp.asarray(lengths[i:i + batch_size]))
        err, norm = err + np.asarray(e), norm + np.asarray(n)
    per_layer = np.sqrt(err / np.maximum(norm, 1e-30))
    return {"mean": float(per_layer.mean()), "per_layer": per_layer.tolist()}
