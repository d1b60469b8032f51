"""The transforms: `quantize(config)` (one weight set) and `dynacore(prefill=, decode=)`
(one model holding a weight set per serving phase).

    model_q = quantize(w4a16(64)).apply(model, quantize(w4a16(64)).calibrate(model, None))
    model_g, _ = calibrate_and_apply(quantize(w4a16(64, method="gptq")), model, cal_data)
    dc = dynacore(prefill=w8a8(), decode=w4a16(64))
    model_dc, state = calibrate_and_apply(dc, model, None)
    generate(model_dc, prompts, max_new_tokens=32)   # prefill W8A8, decode W4A16

Every linear layer is quantized: q/k/v/o, gate/up/down, and an untied LM head. The tied
embedding (SmolLM2) is left in float: it is a gather for the input and the LM head at
once; `weight_bytes` reports it separately.

State (what `calibrate` returns, savable with orbax: `save_state` / `restore_state`):
{"fingerprint": f32 [n_weights, 2] (sum and sum of squares of each float weight it was
made from), "weights": {"<layer>/<name>": {"qvalue", "scale"[, "zero"][, "act_scale"]}}}.
`apply` checks the fingerprint against the model it is given: quantized weights applied
to another model are an error, not a silently wrong model. GPTQ and SmoothQuant settings
need calibration data (a `CalibrationData`); round to nearest needs none.

DynaCore's model holds `PhaseWeights(prefill, decode)` leaves; `Model.prefill_model` /
`Model.decode_model` (research.model.llama) select one set. `generate` and the serving
engine run the prefill view to write the KV cache and the decode view from that cache; a
forward on the undivided model is an error naming the two views.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from research.dynacore.calib import input_stats
from research.dynacore.gptq import ZERO_DTYPE
from research.dynacore.quant import (QuantConfig, QuantizedLinear, check_finite_scale,
                                     quantize_weight)
from research.dynacore.weights import LINEAR_NAMES, linear_weights, replace_weights
from research.model.layers import LinearWeight
from research.model.llama import Model
from research.transforms import CalibrationData, Transform

FINGERPRINT_RTOL = 1e-2  # bf16 vs f32 copies of one model agree to ~1e-3
STATE_ARRAYS = ("qvalue", "scale", "zero", "act_scale")  # QuantizedLinear's, in order


def fingerprint(weights: dict[str, jax.Array]) -> np.ndarray:
    """[n_weights, 2] f32: sum and sum of squares of each weight (cheap identity check)."""
    return np.asarray(_sums(tuple(weights.values())))


@jax.jit
def _sums(ws):
    return jnp.stack([jnp.stack([jnp.sum(w.astype(jnp.float32)),
                                 jnp.sum(jnp.square(w.astype(jnp.float32)))]) for w in ws])


def calibration_stats(model: Model, configs, data) -> dict | None:
    """Input statistics of every linear layer when any config needs them, else None."""
    if not any(c is not None and c.needs_data for c in configs):
        return None
    names = ", ".join(c.name for c in configs if c is not None and c.needs_data)
    if data is None:
        raise ValueError(f"{names} needs calibration data: pass a CalibrationData "
                         "(research.transforms) as calibrate's data")
    if not isinstance(data, CalibrationData):
        raise TypeError(f"data must be a CalibrationData for {names}, got "
                        f"{type(data).__name__}")
    data.validate()
    return input_stats(model, linear_weights(model), data.tokens, data.lengths)


def calibrate_weights(model: Model, config: QuantConfig, stats: dict | None = None) -> dict:
    weights = linear_weights(model)
    state = {}
    for key, w in weights.items():
        q = quantize_weight(w, config, name=f"params {key}",
                            stats=None if stats is None else stats[key])
        state[key] = {name: getattr(q, name) for name in STATE_ARRAYS
                      if getattr(q, name) is not None}
    return {"fingerprint": fingerprint(weights), "weights": state}


def _check_state(model: Model, state, config: QuantConfig) -> dict[str, jax.Array]:
    weights = linear_weights(model)
    if not isinstance(state, dict) or set(state) != {"fingerprint", "weights"}:
        raise ValueError("state must be the dict `quantize(...).calibrate` returns, with "
                         f"keys 'fingerprint' and 'weights', got {type(state).__name__}")
    if set(state["weights"]) != set(weights):
        raise ValueError(f"quantized weights were made for another model: they cover "
                         f"{len(state['weights'])} weights, this model has {len(weights)}")
    fp = np.asarray(state["fingerprint"])
    mine = fingerprint(weights)
    if fp.shape != mine.shape or not np.allclose(fp, mine, rtol=FINGERPRINT_RTOL,
                                                 atol=1e-3):
        bad = list(weights)[int(np.argmax(np.abs(fp - mine).max(-1)))] \
            if fp.shape == mine.shape else "shapes"
        raise ValueError(f"quantized weights were made from another model: the float "
                         f"weights' fingerprint differs (first at {bad}); calibrate on "
                         "this model")
    zero_dtype = ZERO_DTYPE[config.zero_point] if config.weight_bits == 4 else None
    want_arrays = ({"qvalue", "scale"} | ({"zero"} if zero_dtype is not None else set())
                   | ({"act_scale"} if config.smooth is not None else set()))
    for key, entry in state["weights"].items():
        k, n = weights[key].shape
        want = (k, n) if config.weight_bits == 8 else (k // 2, n)
        if (tuple(entry["qvalue"].shape) != want or set(entry) != want_arrays
                or (zero_dtype is not None and np.dtype(entry["zero"].dtype) != zero_dtype)):
            raise ValueError(f"state weight {key} (arrays {sorted(entry)}, codes "
                             f"{tuple(entry['qvalue'].shape)}) does not match "
                             f"{config.name} for a [{k}, {n}] weight")
        check_finite_scale(entry["scale"], f"state weight {key}")
    return weights


def _quantized(model: Model, state, config: QuantConfig) -> dict[str, QuantizedLinear]:
    weights = _check_state(model, state, config)
    return {key: QuantizedLinear(*(None if e.get(name) is None else jnp.asarray(e[name])
                                   for name in STATE_ARRAYS),
                                 config, tuple(weights[key].shape))
            for key, e in state["weights"].items()}


def quantize(config: QuantConfig) -> Transform:
    """Every linear weight quantized with `config` (module docstring). Calibration data
    (a CalibrationData) is needed when `config.needs_data` (GPTQ, SmoothQuant)."""
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a QuantConfig (w8a8(), w8a16(), w4a16(g)), got "
                        f"{type(config).__name__}")

    def calibrate(model, data):
        return calibrate_weights(model, config, calibration_stats(model, [config], data))

    def apply(model, state):
        return replace_weights(model, _quantized(model, state, config), config.name)

    return Transform(calibrate, apply, config.name)


@struct.dataclass
class PhaseWeights(LinearWeight):
    """One linear layer's two weight sets: `prefill` and `decode` (each a QuantizedLinear
    or a float array)."""

    prefill: object
    decode: object

    def for_phase(self, phase: str):
        return self.prefill if phase == "prefill" else self.decode

    def linear(self, x):
        raise ValueError("this model holds one weight set per phase (DynaCore): run "
                         "model.prefill_model to prefill and model.decode_model to decode")

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in jax.tree.leaves(self))


def dynacore(prefill: QuantConfig | None, decode: QuantConfig | None) -> Transform:
    """Phase-specific weights: `prefill` serves prompts (writes the KV cache), `decode`
    continues from that cache. None = the float weights for that phase. State: the pair
    of `quantize` states (None for a float phase)."""
    for arg, cfg in (("prefill", prefill), ("decode", decode)):
        if cfg is not None and not isinstance(cfg, QuantConfig):
            raise TypeError(f"{arg} must be a QuantConfig or None (float), got "
                            f"{type(cfg).__name__}")

    def calibrate(model, data):
        stats = calibration_stats(model, (prefill, decode), data)  # shared by both sets
        return tuple(None if c is None else calibrate_weights(model, c, stats)
                     for c in (prefill, decode))

    def apply(model, state):
        if not isinstance(state, (tuple, list)) or len(state) != 2:
            raise ValueError("dynacore state must be a (prefill, decode) pair")
        floats = linear_weights(model)
        sets = [floats if c is None else _quantized(model, s, c)
                for c, s in zip((prefill, decode), state)]
        new = {key: PhaseWeights(sets[0][key], sets[1][key]) for key in floats}
        name = lambda c: "f32" if c is None else c.name  # noqa: E731
        return replace_weights(model, new, f"dynacore({name(prefill)}|{name(decode)})")

    name = f"dynacore({'f' if prefill is None else prefill.name}|" \
           f"{'f' if decode is None else decode.name})"
    return Transform(calibrate, apply, name)


def weight_bytes(model: Model) -> dict[str, int]:
    """Bytes of the real param arrays: "linear" (every linear weight, all sets), "embed"
    (the embedding / tied LM head), "other" (norms), "total"."""
    p = model.params
    lin = sum(int(a.nbytes) for i, layer in enumerate(p["layers"]) for name in LINEAR_NAMES
              for a in jax.tree.leaves(layer[name]))
    if "lm_head" in p:
        lin += sum(int(a.nbytes) for a in jax.tree.leaves(p["lm_head"]))
    embed = int(p["embed"].nbytes)
    total = sum(int(a.nbytes) for a in jax.tree.leaves(p))
    return {"linear": lin, "embed": embed, "other": total - lin - embed, "total": total}


def save_state(path, state) -> None:
    """Save a `quantize` / `dynacore` state with orbax (the stored bytes: codes stay int8 /
    packed uint8)."""
    import orbax.checkpoint as ocp
    from pathlib import Path
    tree = {"sets": [{} if s is None else s for s in state]} \
        if isinstance(state, tuple) else {"single": state}
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(Path(path).resolve(), tree)


def restore_state(path):
    """Inverse of `save_state` (arrays come back as saved: same dtypes and shapes)."""
    import orbax.checkpoint as ocp
    from pathlib import Path
    with ocp.StandardCheckpointer() as ckpt:
        tree = ckpt.restore(Path(path).resolve())
    if "single" in tree:
        return tree["single"]
    return tuple(None if not s else s for s in tree["sets"])
