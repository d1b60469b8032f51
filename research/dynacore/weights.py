"""The model's linear weights by key ("<layer>/<name>", "lm_head"): read them out, put
replacements in. Below both calibration (calib.py records each weight's inputs by
swapping in recorders) and the quantize transforms (transform.py)."""
from __future__ import annotations

import jax

from research.model.layers import LinearWeight
from research.model.llama import Model

LINEAR_NAMES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def linear_weights(model: Model) -> dict[str, jax.Array]:
    """{"<layer>/<name>": float [K, N]} for every linear weight quantization covers."""
    c = model.config
    out = {}
    for i, p in enumerate(model.params["layers"]):
        if c.is_moe(i):
            raise ValueError(f"layer {i} is an MoE layer: quantizing expert weights "
                             "[E, K, N] is not supported (dense FFN layers only)")
        for name in LINEAR_NAMES:
            out[f"{i}/{name}"] = p[name]
    if not c.tie_embeddings:
        out["lm_head"] = model.params["lm_head"]
    for key, w in out.items():
        if isinstance(w, LinearWeight):
            raise ValueError(f"weight {key} is already quantized ({type(w).__name__}): "
                             "quantize the float model")
    return out


def replace_weights(model: Model, new: dict, tag: str) -> Model:
    params = dict(model.params)
    layers = [dict(p) for p in params["layers"]]
    for key, w in new.items():
        if key == "lm_head":
            params["lm_head"] = w
        else:
            i, name = key.split("/")
            layers[int(i)][name] = w
    params["layers"] = tuple(layers)
    return model.replace(params=params, tags=model.tags + (tag,))
