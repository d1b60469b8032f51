"""PatchKV: a closed-form ridge patch of each layer's output projection, fit once per context,
that makes attention over a compressed KV cache act like attention over the full one.

For layer l with output projection W_o [Hq*Dh, D], probe tokens placed after the context
give attention outputs o_cmp (over the incoming model's compressed cache) and o_ref (over
a full-precision dense reference cache of the same context). The patch solves

    Delta_l = argmin ||o_cmp Delta - (o_ref W_o - o_cmp W_o)||^2 + lam ||Delta||^2

in closed form (`research.patchkv.ridge`), with lam chosen on held-out probe rows (or GCV),
and folds it into the weight: W_o <- W_o + Delta_l. The patched model has the same
parameter shapes and the same per-token compute as the unpatched one.

Generic over the compression: the patch fits against whatever caches the incoming model
has (an evicting cache, a quantized codec, ...), so `chain(evict(...), patchkv())` and
`chain(<quantizer>, patchkv())` both work.

Fitting order (`sequential=True`, default): layers are fit bottom-up and layer l's probe
queries come from the model whose layers < l are already patched and compressed, i.e. the
model as deployed; `sequential=False` fits every layer on queries taken from the
reference stream (independent, teacher-forced). `target="residual"` additionally asks
layer l's patch to cancel the drift its input already carries from lower layers.

Serving protocol (one context, many queries): the context is prefilled once by the
*incoming* (unpatched) model, which builds the compressed cache the patch was fit for;
the patched model then serves every query over that cache (`research.patchkv.session`).
The patch is specific to the context it was fit on.
"""
from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from research.kv.base import state_nbytes
from research.model.llama import Model, default_caches
from research.patchkv import layerwise, ridge
from research.patchkv.probes import ProbeConfig, ProbeSet, build_probes
from research.patchkv.session import prefill_batch, tile_states
from research.transforms import CalibrationData, Transform

TARGETS = ("attention", "residual")


class LayerFit(NamedTuple):
    layer: int
    alpha: float  # chosen relative penalty (inf = left unpatched)
    lam: float
    train_rel_err: tuple[float, float]  # attention-contribution error before / after
    val_rel_err: tuple[float, float]  # same on held-out probe rows


class PatchState(NamedTuple):
    """Transform state: one [Hq*Dh, D] delta per layer (zeros where unpatched) + report."""

    deltas: tuple
    fits: tuple  # LayerFit per layer (host-side diagnostics)
    fit_seconds: float  # layer-by-layer fitting (after probes and prefill)
    probe_seconds: float  # building probes + prefilling the context twice
    n_probe_tokens: int


def reference_model(model: Model) -> Model:
    """The same params with full-precision dense caches (window rings for sliding layers)."""
    return model.replace(caches=default_caches(model.config, "float32"))


def patched_params(model: Model, deltas: Sequence) -> dict:
    layers = model.params["layers"]
    if len(deltas) != len(layers):
        raise ValueError(f"patch has {len(deltas)} layers, model has {len(layers)}")
    new_layers = []
    for i, (p, d) in enumerate(zip(layers, deltas)):
        if d.shape != p["wo"].shape:
            raise ValueError(f"layer {i}: patch shape {d.shape} != wo shape {p['wo'].shape}")
        new_layers.append({**p, "wo": (p["wo"].astype(jnp.float32) + d).astype(p["wo"].dtype)})
    return {**model.params, "layers": tuple(new_layers)}


def apply_patch(model: Model, state: PatchState) -> Model:
    return model.replace(params=patched_params(model, state.deltas),
                         tags=model.tags + ("patchkv",))


def patch_nbytes(state: PatchState) -> int:
    """Bytes of the non-zero layer patches (f32): what a server stores per context."""
    return sum(int(d.nbytes) for d in state.deltas if bool(jnp.any(d != 0)))


def _valid_rows(a: jax.Array, lengths: np.ndarray) -> np.ndarray:
    """Flatten [P, m, ...] to the real tokens' rows [N, ...] (float64)."""
    a = np.asarray(a, np.float64)
    mask = np.arange(a.shape[1])[None, :] < lengths[:, None]
    return a[mask]


def fit_patches(model: Model, contexts: CalibrationData, probes: ProbeSet | ProbeConfig, *,
                ridge_config: ridge.RidgeConfig = ridge.RidgeConfig(),
                sequential: bool = True, target: str = "attention",
                layers: Sequence[int] | None = None) -> PatchState:
    """Fit the per-layer patches of `model` (whose caches compress) for `contexts`."""
    _validate(model, contexts, target, layers)
    c = model.config
    tokens, lengths = np.asarray(contexts.tokens), np.asarray(contexts.lengths)
    ref = reference_model(model)
    t0 = time.perf_counter()
    probe_len = probes.length if isinstance(probes, ProbeConfig) else probes.tokens.shape[1]
    max_len = int(lengths.max()) + probe_len
    _, cmp_states = prefill_batch(model, tokens, lengths, max_len)
    ref_logits, ref_states = prefill_batch(ref, tokens, lengths, max_len)
    if isinstance(probes, ProbeConfig):
        probes = build_probes(ref, tokens, lengths, ref_states, ref_logits, probes)
    jax.block_until_ready(probes.tokens)
    t1 = time.perf_counter()

    start = jnp.asarray(lengths[probes.context], jnp.int32)
    n_new = jnp.asarray(probes.lengths, jnp.int32)
    holdout = np.repeat(probes.holdout, probes.lengths)
    x_ref = layerwise.embed(model, probes.tokens)
    x_cmp = x_ref
    to_fit = set(range(c.n_layers) if layers is None else layers)
    deltas, fits = [], []
    for layer in range(c.n_layers):
        s_ref = tile_states(ref_states[layer:layer + 1], probes.context)[0]
        s_cmp = tile_states(cmp_states[layer:layer + 1], probes.context)[0]
        x_ref_out, cap_ref = layerwise.run_layer(layerwise.layer_view(ref, layer), x_ref,
                                                 start, n_new, s_ref)
        x_in = x_cmp if sequential else x_ref
        view = layerwise.layer_view(model, layer)
        x_cmp_out, cap_cmp = layerwise.run_layer(view, x_in, start, n_new, s_cmp)
        delta = jnp.zeros_like(model.params["layers"][layer]["wo"], dtype=jnp.float32)
        if layer in to_fit:
            fit = _fit_layer(model, layer, cap_cmp["attn"], cap_ref["attn"],
                             x_ref - x_in if target == "residual" else None,
                             probes.lengths, holdout, ridge_config)
            fits.append(fit[1])
            if np.any(fit[0]):
                delta = jnp.asarray(fit[0], jnp.float32)
                if sequential:
                    p = patched_params(layerwise.layer_view(model, layer), [delta])
                    x_cmp_out, _ = layerwise.run_layer(
                        layerwise.layer_view(model, layer, p["layers"][0]), x_in, start,
                        n_new, s_cmp)
        deltas.append(delta)
        x_ref = x_ref_out
        x_cmp = x_cmp_out if sequential else x_ref_out
    jax.block_until_ready(deltas)
    return PatchState(tuple(deltas), tuple(fits), time.perf_counter() - t1, t1 - t0,
                      probes.n_tokens)


def _fit_layer(model, layer, o_cmp, o_ref, drift, lengths, holdout, config):
    wo = np.asarray(model.params["layers"][layer]["wo"], np.float64)
    x = _valid_rows(o_cmp, lengths)
    y = _valid_rows(o_ref, lengths) @ wo - x @ wo
    if drift is not None:
        y = y + _valid_rows(drift, lengths)
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise FloatingPointError(f"layer {layer}: probe attention outputs are not finite")
    use_holdout = holdout if config.selection == "holdout" else None
    fit = ridge.fit_ridge(x, y, use_holdout, config)
    return fit.delta, LayerFit(layer, fit.alpha, fit.lam, fit.train_rel_err, fit.val_rel_err)


def _validate(model, contexts, target, layers):
    if contexts is None:
        raise ValueError("patchkv needs the context as calibration data "
                         "(CalibrationData of the context tokens); got None")
    if not isinstance(contexts, CalibrationData):
        raise TypeError(f"contexts must be CalibrationData, got {type(contexts).__name__}")
    contexts.validate()
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if layers is not None:
        bad = [i for i in layers if not 0 <= i < model.config.n_layers]
        if bad:
            raise ValueError(f"layers {bad} out of range [0, {model.config.n_layers})")


def patchkv(*, probes: ProbeConfig = ProbeConfig(),
            ridge_config: ridge.RidgeConfig = ridge.RidgeConfig(), sequential: bool = True,
            target: str = "attention", layers: Sequence[int] | None = None) -> Transform:
    """Transform: calibrate on the context (CalibrationData), return the patched model.

    Prefill the context with the model *before* this transform (it builds the compressed
    cache); serve queries with the patched model (see the module docstring).
    """
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if not isinstance(probes, ProbeConfig):
        raise TypeError(f"probes must be a ProbeConfig, got {type(probes).__name__}")

    def calibrate(model, data):
        return fit_patches(model, data, probes, ridge_config=ridge_config,
                           sequential=sequential, target=target, layers=layers)

    def apply(model, state):
        if not isinstance(state, PatchState):
            raise TypeError(f"patchkv state must be a PatchState, got {type(state).__name__}")
        return apply_patch(model, state)

    name = f"patchkv({'seq' if sequential else 'indep'},{target},{ridge_config.selection})"
    return Transform(calibrate, apply, name)


def summarize(state: PatchState) -> dict:
    """Mean train/held-out relative errors before/after, layers patched, bytes, times."""
    fits = state.fits
    mean = lambda xs: float(np.nanmean(xs)) if len(xs) else float("nan")  # noqa: E731
    return {"layers_patched": sum(1 for f in fits if np.isfinite(f.alpha)),
            "train_err_before": mean([f.train_rel_err[0] for f in fits]),
            "train_err_after": mean([f.train_rel_err[1] for f in fits]),
            "val_err_before": mean([f.val_rel_err[0] for f in fits]),
            "val_err_after": mean([f.val_rel_err[1] for f in fits]),
            "patch_bytes": patch_nbytes(state), "fit_seconds": state.fit_seconds,
            "probe_seconds": state.probe_seconds, "probe_tokens": state.n_probe_tokens}


del dataclasses, state_nbytes  # (kept out of the public namespace)
