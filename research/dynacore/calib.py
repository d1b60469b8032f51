"""Input statistics of every linear layer on calibration tokens, for the data-aware
quantizers (GPTQ's Hessian, SmoothQuant's per-channel activation range).

Each projection's float weight is wrapped in a `_Recorder` (a `LinearWeight`, the model's
one weight hook) and the model runs eagerly over the calibration batch; the recorder adds
x^T x and max|x| of the real (unpadded) rows it sees, then returns x @ w unchanged. Inputs
shared by several projections (q/k/v read one normed x, gate/up another) are summed once.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from research.dynacore.weights import replace_weights
from research.model.layers import LinearWeight
from research.model.llama import forward


@dataclasses.dataclass
class InputStats:
    """One projection's calibration inputs: xtx [K, K] f64 (sum of x^T x), absmax [K]
    (max |x| per input channel), rows (how many token rows were summed)."""

    xtx: np.ndarray
    absmax: np.ndarray
    rows: int

    @property
    def hessian(self) -> np.ndarray:
        """GPTQ's H = X^T X / rows (the scale does not change GPTQ's result, it keeps the
        damping term comparable across layers)."""
        return self.xtx / max(self.rows, 1)

    def merged(self, other: "InputStats | None") -> "InputStats":
        if other is None:
            return self
        return InputStats(self.xtx + other.xtx, np.maximum(self.absmax, other.absmax),
                          self.rows + other.rows)


class _Sink:
    """Accumulates per-key stats over batches; `mask` marks the current batch's real
    tokens; `last` remembers the input seen last so a projection reading the same x as
    the one before reuses its sums."""

    def __init__(self):
        self.mask: np.ndarray | None = None  # [B*T] bool
        self.stats: dict[str, InputStats] = {}
        self.last: tuple[object, InputStats] | None = None

    def add(self, key: str, x) -> None:
        if self.last is not None and self.last[0] is x:
            add = self.last[1]
        else:
            x2 = np.asarray(x, np.float64).reshape(-1, x.shape[-1])[self.mask]
            add = InputStats(x2.T @ x2, np.abs(x2).max(0), len(x2))
            self.last = (x, add)
        self.stats[key] = add.merged(self.stats.get(key))


@dataclasses.dataclass(frozen=True, eq=False)
class _Recorder(LinearWeight):
    weight: object
    key: str
    sink: _Sink

    def linear(self, x):
        self.sink.add(self.key, x)
        return x @ self.weight


def input_stats(model, weights: dict, tokens, lengths, batch_size: int = 4
                ) -> dict[str, InputStats]:
    """{key: InputStats} for each float weight in `weights` ({"<layer>/<name>": [K, N]}
    as `weights.linear_weights` gives), from the model run over `tokens` [B, T]
    (row b's real tokens are tokens[b, :lengths[b]])."""
    tokens = np.asarray(tokens, np.int32)
    lengths = np.asarray(lengths, np.int32)
    if tokens.ndim != 2 or tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise ValueError(f"calibration tokens must be a non-empty [B, T] batch, got "
                         f"{tokens.shape=}")
    sink = _Sink()
    recording = replace_weights(model, {k: _Recorder(w, k, sink) for k, w in weights.items()},
                                "calibrating")
    for b0 in range(0, tokens.shape[0], batch_size):
        tok, n = tokens[b0:b0 + batch_size], lengths[b0:b0 + batch_size]
        sink.mask = (np.arange(tok.shape[1])[None, :] < n[:, None]).reshape(-1)
        # an untied LM head only sees inputs when logits are computed
        forward(recording, jnp.asarray(tok), n_new=jnp.asarray(n),
                logits="all" if "lm_head" in weights else "none")
    out = sink.stats
    missing = set(weights) - set(out)
    if missing:
        raise RuntimeError(f"calibration saw no input for {sorted(missing)[:3]}")
    return out
