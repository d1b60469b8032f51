"""The transform protocol (see research/transforms.py for the user-facing description).

Kept in research.core so KV-cache modules (eviction policies are transforms) can build
transforms without depending on research.transforms, which depends on research.kv.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

if TYPE_CHECKING:
    from research.model.llama import Model

State = Any


class CalibrationData(NamedTuple):
    """Right-padded calibration token batch: row b's tokens are tokens[b, :lengths[b]]."""

    tokens: Int[Array, "B T"]
    lengths: Int[Array, "B"]

    @classmethod
    def from_ids(cls, ids: Sequence[int], seq_len: int, n_seqs: int) -> "CalibrationData":
        """`n_seqs` consecutive, non-overlapping `seq_len`-token slices of `ids`."""
        ids = np.asarray(ids, np.int32)
        if seq_len < 1 or n_seqs < 1:
            raise ValueError(f"seq_len and n_seqs must be >= 1, got {seq_len=}, {n_seqs=}")
        if len(ids) < seq_len * n_seqs:
            raise ValueError(f"calibration text has {len(ids)} tokens, need "
                             f"seq_len*n_seqs={seq_len * n_seqs}")
        tokens = ids[:seq_len * n_seqs].reshape(n_seqs, seq_len)
        return cls(jnp.asarray(tokens), jnp.full((n_seqs,), seq_len, jnp.int32))

    def validate(self) -> None:
        if self.tokens.ndim != 2 or self.tokens.shape[0] == 0 or self.tokens.shape[1] == 0:
            raise ValueError(f"calibration tokens must be a non-empty [B, T] batch, got "
                             f"{self.tokens.shape=}")
        if int(jnp.min(self.lengths)) < 1:
            raise ValueError("calibration data has an empty sequence (lengths must be >= 1)")


class Transform(NamedTuple):
    calibrate: Callable[[Model, CalibrationData], State]
    apply: Callable[[Model, State], Model]
    name: str = "transform"


def identity() -> Transform:
    return Transform(lambda model, data: (), lambda model, state: model, "identity")


def frozen(transform: Transform, state: State) -> Transform:
    """`transform` with a state calibrated earlier (e.g. a TaSQ codebook calibrated once per
    model, then chained with a per-context PatchKV fit): calibrate returns `state`."""
    return Transform(lambda model, data: state, transform.apply, transform.name)


def chain(*transforms: Transform) -> Transform:
    """Sequential composition; state is the tuple of each transform's state."""

    def calibrate(model: Model, data: CalibrationData):
        states = []
        for t in transforms:
            state = t.calibrate(model, data)
            model = t.apply(model, state)
            states.append(state)
        return tuple(states)

    def apply(model: Model, states):
        if len(states) != len(transforms):
            raise ValueError(f"chain of {len(transforms)} transforms got {len(states)} states")
        for t, s in zip(transforms, states):
            model = t.apply(model, s)
        return model

    return Transform(calibrate, apply, "+".join(t.name for t in transforms) or "identity")


def calibrate_and_apply(transform: Transform, model: Model,
                        data: CalibrationData | None) -> tuple[Model, State]:
    """Convenience: (transformed model, calibration state)."""
    if data is not None:
        data.validate()
    state = transform.calibrate(model, data)
    return transform.apply(model, state), state
