"""A fingerprint of the model a calibration belongs to: its config and attention weights."""
from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

from research.model.llama import Model

FINGERPRINT_WEIGHTS = ("wq", "wk", "wv", "wo")


def model_fingerprint(model: Model) -> str:
    """sha256 (hex) of the ModelConfig and every layer's W_q, W_k, W_v, W_o bytes."""
    h = hashlib.sha256()
    h.update(json.dumps(dataclasses.asdict(model.config), sort_keys=True,
                        default=str).encode())
    for i, p in enumerate(model.params["layers"]):
        for name in FINGERPRINT_WEIGHTS:
            a = np.asarray(p[name])
            h.update(f"{i}/{name}/{a.shape}/{a.dtype}".encode())
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def check_fingerprint(model: Model, expected: str, what: str) -> None:
    got = model_fingerprint(model)
    if got != expected:
        raise ValueError(
            f"{what} was calibrated for a different model (fingerprint {expected[:12]}..., "
            f"this model is {got[:12]}...): config or attention weights differ. Recalibrate "
            "on this model (note: applying TaSQ twice also trips this, since the first "
            "application folds scales into the weights).")
