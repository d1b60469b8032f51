"""Folding per-channel K/V scales into the projection weights, exactly.

Keys: a scale s per channel with s[i] == s[i + D/2] (both members of a RoPE pair) commutes
with RoPE (a pair rotates as a 2-D vector; scaling it uniformly commutes with the
rotation), so
    W_k[:, h, c] *= s[h, c],   W_q[:, j, c] /= s[h(j), c]     for every query head j of h
leaves every score q.k unchanged. Values: W_v[:, h, c] *= t[h, c] and W_o[j, c, :] /= t[h(j), c]
leave the attention output after W_o unchanged (softmax weights are linear in v).
Only the cache then sees rescaled K/V. Per-head scalars (cross-head normalisation) are the
special case of a constant scale per head.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from research.model.llama import Model


def check_rope_pair_tied(key_scale: np.ndarray, name: str = "key_scale") -> None:
    d = key_scale.shape[-1]
    if d % 2 or not np.allclose(key_scale[..., : d // 2], key_scale[..., d // 2:],
                                rtol=1e-6, atol=0):
        raise ValueError(f"{name} must give both channels of each RoPE pair (i, i + D/2) "
                         "the same scale, or it would not commute with RoPE")


def _check_scale(x, name: str, shape: tuple) -> np.ndarray:
    x = np.asarray(x, np.float32)
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {x.shape}")
    if not np.isfinite(x).all() or (x <= 0).any():
        raise ValueError(f"{name} must be finite and > 0")
    return x


def fold_kv_scales(model: Model, key_scale, value_scale) -> Model:
    """New Model whose caches see k * key_scale and v * value_scale (per layer, head,
    channel; arrays [L, Hkv, D]) while its outputs are unchanged."""
    c = model.config
    shape = (c.n_layers, c.n_kv_heads, c.head_dim)
    ks = _check_scale(key_scale, "key_scale", shape)
    vs = _check_scale(value_scale, "value_scale", shape)
    check_rope_pair_tied(ks)
    layers = []
    for i, p in enumerate(model.params["layers"]):
        dt = p["wq"].dtype
        kq = jnp.asarray(ks[i])  # [Hkv, D]
        kv = jnp.asarray(vs[i])
        dim = p["wq"].shape[0]
        wq = p["wq"].astype(jnp.float32).reshape(dim, c.n_kv_heads, c.q_per_kv, c.head_dim)
        wk = p["wk"].astype(jnp.float32).reshape(dim, c.n_kv_heads, c.head_dim)
        wv = p["wv"].astype(jnp.float32).reshape(dim, c.n_kv_heads, c.head_dim)
        wo = p["wo"].astype(jnp.float32).reshape(c.n_kv_heads, c.q_per_kv, c.head_dim, -1)
        layers.append({**p,
                       "wq": (wq / kq[None, :, None, :]).reshape(p["wq"].shape).astype(dt),
                       "wk": (wk * kq[None]).reshape(p["wk"].shape).astype(dt),
                       "wv": (wv * kv[None]).reshape(p["wv"].shape).astype(dt),
                       "wo": (wo / kv[:, None, :, None]).reshape(p["wo"].shape).astype(dt)})
    return model.replace(params={**model.params, "layers": tuple(layers)})
