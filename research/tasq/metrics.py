"""Measurements shared by the experiment, notebook and tests: cache bytes, bits per
channel, attention-output error of a cache codec."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from research.kv import memory
from research.model.llama import Model, forward


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


@functools.partial(jax.jit, static_argnames=())
def _layer_errors(model: Model, tokens, lengths):
    """Per layer: |(codec_out - exact_out) W_o| and |exact_out W_o| summed over real tokens."""
    c = model.config
    out = forward(model, tokens, n_new=lengths, logits="none", capture=True)
    b, t = tokens.shape
    valid = (jnp.arange(t)[None, :] < lengths[:, None])[..., None]
    zeros = jnp.zeros((b,), jnp.int32)
    errs, norms = [], []
    for layer, cap in enumerate(out.captures):
        cache = model.caches[layer]
        state = cache.init(b, t, c.n_kv_heads, c.head_dim)
        approx, _ = cache.update_and_attend(state, cap["q"], cap["k"], cap["v"], start=zeros,
                                            n_new=lengths, window=c.window(layer))
        wo = model.params["layers"][layer]["wo"].astype(jnp.float32)
        exact = cap["attn"].astype(jnp.float32) @ wo
        diff = approx.reshape(b, t, -1).astype(jnp.float32) @ wo - exact
        errs.append(jnp.sum(jnp.where(valid, diff * diff, 0.0)))
        norms.append(jnp.sum(jnp.where(valid, exact * exact, 0.0)))
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
