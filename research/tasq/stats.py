"""Calibration statistics collected through the real model (forward(..., capture=True)).

Per layer: post-RoPE keys, pre-RoPE keys, values of every real calibration token, and the
second moments of the queries that read each KV head (pooled over its query heads).
Only calibration text goes in here; evaluation text never does.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from research.model.llama import Model, forward
from research.transforms import CalibrationData


class LayerStats(NamedTuple):
    k: np.ndarray       # [N, Hkv, D] post-RoPE keys
    k_pre: np.ndarray   # [N, Hkv, D] pre-RoPE keys
    v: np.ndarray       # [N, Hkv, D]
    q_sq: np.ndarray    # [Hkv, D] E[q_c^2] over tokens and the KV head's query heads


@jax.jit
def _capture(model: Model, tokens, lengths):
    out = forward(model, tokens, n_new=lengths, logits="none", capture=True)
    return tuple({k: c[k] for k in ("q", "k", "k_pre", "v")} for c in out.captures)


def collect(model: Model, data: CalibrationData, batch_size: int = 4,
            progress: bool = False) -> list[LayerStats]:
    """Run the calibration batch through `model` and gather per-layer statistics."""
    if data is None:
        raise ValueError("calibration data is required (got None)")
    data.validate()
    c = model.config
    tokens, lengths = np.asarray(data.tokens), np.asarray(data.lengths)
    acc = [{"k": [], "k_pre": [], "v": [], "q_sq": 0.0} for _ in range(c.n_layers)]
    n_total = 0
    for i in tqdm(range(0, len(tokens), batch_size), desc="calibration", disable=not progress):
        tok, ln = tokens[i:i + batch_size], lengths[i:i + batch_size]
        caps = _capture(model, jnp.asarray(tok), jnp.asarray(ln))
        valid = np.arange(tok.shape[1])[None, :] < ln[:, None]  # [b, T]
        n_total += int(valid.sum())
        for layer, cap in enumerate(caps):
            for name in ("k", "k_pre", "v"):
                acc[layer][name].append(np.asarray(cap[name], np.float32)[valid])
            q = np.asarray(cap["q"], np.float32)[valid]  # [n, Hq, D]
            q = q.reshape(q.shape[0], c.n_kv_heads, c.q_per_kv, c.head_dim)
            acc[layer]["q_sq"] = acc[layer]["q_sq"] + np.sum(q * q, axis=(0, 2))
    stats = []
    for layer, a in enumerate(acc):
        s = LayerStats(np.concatenate(a["k"]), np.concatenate(a["k_pre"]),
                       np.concatenate(a["v"]), a["q_sq"] / (n_total * c.q_per_kv))
        for name, x in (("k", s.k), ("v", s.v)):
            if not np.isfinite(x).all():
                raise ValueError(f"calibration {name} of layer {layer} contains NaN or inf")
        stats.append(s)
    return stats
