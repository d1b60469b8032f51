"""The transform protocol: how a technique plugs into servax (the one home of the protocol).

A technique is a `Transform`, a NamedTuple of two pure functions (optax style):

    calibrate(model, data) -> state     # look at the model on calibration data
    apply(model, state)    -> model     # return a new Model (params, caches, ...)

`state` is a pytree (codebooks, patches, plans), so it can be saved with orbax and
re-applied without recalibrating. `chain(a, b)` calibrates `b` on the model `a` produced:
`chain(evict("snapkv", 0.1), patchkv())` keeps 10% of the context's KV per head, then
fits a ridge weight patch that compensates what eviction lost. `stateless(apply, name)` is a transform with nothing
to calibrate (a cache swap, a dtype cast); `frozen(t, state)` reuses a calibration made
earlier (e.g. a codebook calibrated once per model).

Calibration data. `data` is a `CalibrationData` batch of token rows (or None for
transforms that need none). Every transform of a chain sees the same `data`.

Per-context transforms (the one extension of the protocol). Some techniques are fit for
one context and serve only that context: PatchKV's weight patch and the GRKV / AM
value refits (`research.patchkv`). For them:

* `data` is the context: a `CalibrationData` whose rows are the context(s). Such a
  transform may also accept richer data derived from that context and documented by its
  technique, which several transforms then share instead of each rebuilding it:
  `research.patchkv.ProbedContext` (the context's tokens with the probe rows and the
  full-cache reference pass built by `probe_context`) is accepted by every PatchKV-family
  transform, so all methods compared on one context fit on the same probes. Transforms
  that do not look at the data (`evict`, `frozen(tasq, ...)`) ignore it.
  `calibrate_and_apply` validates a `CalibrationData`; a richer object was validated when
  it was built.
* Serving: the context's cache is prefilled by the model *before* the first transform
  that changes weights per context (PatchKV): its patch was fit for the cache that model
  builds, so `chain(evict(...), patchkv())` serves queries with the patched model over
  the cache the evicting model prefilled (`research.patchkv.session`). Transforms that
  change the cache's *contents* per context (the value refits) do it through the model's
  caches, so prefilling with their model already gives the refit cache.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

if TYPE_CHECKING:  # annotations only: research.kv and research.model import this module
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

    @classmethod
    def from_corpus(cls, tokenizer, seq_len: int, n_seqs: int) -> "CalibrationData":
        """`from_ids` over the calibration split of the embedded corpus (research/data.py:
        text no experiment scores), tokenized by `tokenizer`: every calibrated transform's
        default data."""
        from research import data  # a leaf module: no import circle
        return cls.from_ids(tokenizer.encode(data.corpus_text("calibration")), seq_len, n_seqs)

    @classmethod
    def from_context(cls, context: Sequence[int]) -> "CalibrationData":
        """One context (1-D token ids) as the data of a per-context transform."""
        ids = np.asarray(context, np.int32)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"context must be a non-empty 1-D token sequence, got "
                             f"{ids.shape=}")
        return cls(jnp.asarray(ids[None]), jnp.asarray([ids.size], jnp.int32))

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


def stateless(apply: Callable[[Model, State], Model], name: str) -> Transform:
    """A transform with nothing to calibrate: its state is `()` and `apply(model, ())`
    gives the new model."""
    if not callable(apply):
        raise TypeError(f"apply must be callable (model, state) -> Model, got "
                        f"{type(apply).__name__}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    return Transform(lambda model, data: (), apply, name)


def identity() -> Transform:
    return stateless(lambda model, state: model, "identity")


def frozen(transform: Transform, state: State) -> Transform:
    """`transform` with a state calibrated earlier (e.g. a TaSQ codebook calibrated once per
    model, then chained with a per-context PatchKV fit): calibrate returns `state`."""
    return Transform(lambda model, data: state, transform.apply, transform.name)


def chain(*transforms: Transform) -> Transform:
    """Sequential composition; state is the tuple of each transform's state."""
    for i, t in enumerate(transforms):
        if not isinstance(t, Transform):
            raise TypeError(f"chain: argument {i} must be a Transform, got "
                            f"{type(t).__name__}")

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


def calibrate_and_apply(transform: Transform, model: Model, data) -> tuple[Model, State]:
    """Convenience: (transformed model, calibration state). `data`: a CalibrationData (it
    is validated here), None, or a technique's richer per-context data (module docstring)."""
    if isinstance(data, CalibrationData):
        data.validate()
    state = transform.calibrate(model, data)
    return transform.apply(model, state), state
