"""Byte-level tokens and deterministic training batches.

Why bytes: with a 49k-token vocabulary (SmolLM2's) the embedding and softmax would dominate
a dim-128 model on CPU; routing skew is a property of the router, not the tokenizer. Ids
0..255 are UTF-8 bytes; BOS = 256 starts every training window.
"""
from __future__ import annotations

import numpy as np

BOS = 256
VOCAB_SIZE = 257


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def decode(ids) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def batch_at(ids: np.ndarray, step: int, batch_size: int, seq_len: int,
             seed: int) -> np.ndarray:
    """[batch, seq_len + 1] windows (BOS + seq_len bytes) for `step`; a pure function of
    (seed, step), so a resumed run sees exactly the batches an uninterrupted one would."""
    if len(ids) < seq_len + 1:
        raise ValueError(f"corpus has {len(ids)} tokens, need at least seq_len+1={seq_len + 1}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(ids) - seq_len, size=batch_size)
    windows = np.stack([ids[s:s + seq_len] for s in starts])
    return np.concatenate([np.full((batch_size, 1), BOS, np.int32), windows], axis=1)
