"""Save / restore TaSQ calibration artifacts with orbax, bound to the model they fit.

    save_state("/tmp/tasq_smollm2", state)
    state = restore_state("/tmp/tasq_smollm2", model)   # ValueError on another model

A checkpoint holds the arrays (scales, permutations, codebooks) and a JSON item with the
format tag, the TaSQConfig and the model fingerprint (sha256 of ModelConfig + attention
weights, see research/tasq/fingerprint.py).
"""
from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp

from research.model.llama import Model
from research.tasq.config import TaSQConfig
from research.tasq.fingerprint import check_fingerprint
from research.tasq.transform import TaSQState

FORMAT = "servax.tasq/1"
ARRAYS = ("key_scale", "value_scale", "key_perm", "value_perm", "key_codebook",
          "value_codebook")


def _checkpointer():
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def save_state(path: str | Path, state: TaSQState, overwrite: bool = False) -> Path:
    if not isinstance(state, TaSQState):
        raise TypeError(f"state must be a TaSQState, got {type(state).__name__}")
    path = Path(path).absolute()
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists (pass overwrite=True to replace it)")
    arrays = {name: getattr(state, name) for name in ARRAYS}
    meta = {"format": FORMAT, "fingerprint": state.fingerprint,
            "config": state.config.to_dict()}
    _checkpointer().save(path, args=ocp.args.Composite(
        arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)), force=overwrite)
    return path


def restore_state(path: str | Path, model: Model | None = None) -> TaSQState:
    """Load a state; with `model`, also check that it was calibrated for that model."""
    path = Path(path).absolute()
    if not path.is_dir():
        raise FileNotFoundError(f"no TaSQ checkpoint at {path}")
    try:
        restored = _checkpointer().restore(path, args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises several types for missing / corrupt items
        raise ValueError(f"{path} is not a readable TaSQ checkpoint: {e}") from e
    meta, arrays = restored["meta"], restored["arrays"]
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} checkpoint (meta={meta!r})")
    missing = set(ARRAYS) - set(arrays)
    if missing:
        raise ValueError(f"{path} lacks arrays {sorted(missing)}")
    state = TaSQState(**{name: arrays[name] for name in ARRAYS},
                      fingerprint=meta["fingerprint"], config=TaSQConfig(**meta["config"]))
    if model is not None:
        check_fingerprint(model, state.fingerprint, f"the TaSQ checkpoint at {path}")
    return state
