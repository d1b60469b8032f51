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

Strength (`strengths=`): the per-layer penalties are chosen on attention outputs, so the
whole patch is then scaled by the candidate factor (0 always included) with the least
KL(full-cache reference || patched compressed model) on the held-out probe rows: a patch
that does not help the model's next-token distributions is switched off.

Query scale (`query_scales=`, off by default): before the W_o patches are fit, one scalar
on every query head's W_q columns (a logit temperature) competes on the held-out probe
rows by the same KL as the strength (1, no change, always competes). A 1-bit key codebook
returns each key's conditional mean, so the logits lose the spread the coding error
carried and attention comes out too flat; no map of the attention output sharpens it
back. A scalar per head commutes with RoPE and folds into W_q: still zero per-query cost.
(Picking a scale per head by attention-output error instead chose scales below 1: the
squared error rewards hedged, flat attention; experiments/patchkv/README.md.)

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

import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from research.model.llama import Model, unembed
from research.patchkv import layerwise, ridge, session
from research.patchkv.probes import (ProbeConfig, ProbedContext, probe_context,  # noqa: F401
                                     reference_model)
from research.patchkv.session import prefill_batch, tile_states
from research.transforms import Transform

TARGETS = ("attention", "residual")
DEV_STRENGTHS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)  # experiments/patchkv/README.md
DEV_QUERY_SCALES = (0.9, 1.1, 1.2, 1.3, 1.4)  # quantised caches (same README)


class LayerFit(NamedTuple):
    layer: int
    alpha: float  # chosen relative penalty (inf = left unpatched)
    lam: float
    train_rel_err: tuple[float, float]  # attention-contribution error before / after
    val_rel_err: tuple[float, float]  # same on held-out probe rows
    rank: int | None = None  # reduced rank of the patch (None: full rank)


class PatchState(NamedTuple):
    """Transform state: one [Hq*Dh, D] delta per layer (zeros where unpatched) + report."""

    deltas: tuple  # already multiplied by `strength`
    fits: tuple  # LayerFit per layer (host-side diagnostics)
    fit_seconds: float  # compressed prefill (if needed) + layer-by-layer fitting
    probe_seconds: float  # reference prefill + probes + reference pass (shared)
    n_probe_tokens: int
    strength: float = 1.0  # global scale chosen on held-out probe rows (0 = no patch)
    strength_kl: tuple = ()  # (strength, held-out KL(reference || patched)) per candidate
    query_scales: tuple = ()  # per layer [Hq] W_q head scales; () = W_q untouched
    query_scale_kl: tuple = ()  # (scale, held-out KL) per candidate query scale


def patched_params(model: Model, deltas: Sequence, query_scales: Sequence = ()) -> dict:
    """Params with W_o + delta per layer and, if given, W_q's head columns scaled."""
    layers = model.params["layers"]
    if len(deltas) != len(layers):
        raise ValueError(f"patch has {len(deltas)} layers, model has {len(layers)}")
    if query_scales and len(query_scales) != len(layers):
        raise ValueError(f"query_scales has {len(query_scales)} layers, model has "
                         f"{len(layers)}")
    new_layers = []
    for i, (p, d) in enumerate(zip(layers, deltas)):
        if d.shape != p["wo"].shape:
            raise ValueError(f"layer {i}: patch shape {d.shape} != wo shape {p['wo'].shape}")
        new = {**p, "wo": (p["wo"].astype(jnp.float32) + d).astype(p["wo"].dtype)}
        if query_scales:
            new["wq"] = scaled_wq(p["wq"], query_scales[i], model.config.head_dim)
        new_layers.append(new)
    return {**model.params, "layers": tuple(new_layers)}


def scaled_wq(wq: jax.Array, head_scales, head_dim: int) -> jax.Array:
    """W_q [D, Hq*Dh] with each query head's columns times its scale [Hq]."""
    scales = jnp.repeat(jnp.asarray(head_scales, jnp.float32), head_dim)
    if scales.shape != wq.shape[-1:]:
        raise ValueError(f"head scales {np.shape(head_scales)} do not match wq {wq.shape} "
                         f"with head_dim={head_dim}")
    return (wq.astype(jnp.float32) * scales).astype(wq.dtype)


def apply_patch(model: Model, state: PatchState) -> Model:
    return model.replace(params=patched_params(model, state.deltas, state.query_scales),
                         tags=model.tags + ("patchkv",))


def patch_nbytes(state: PatchState) -> int:
    """Bytes of the non-zero layer patches (f32) as a server stores them per context: the
    dense delta, or its two factors [d_in, r] and [r, d_out] for a reduced-rank patch, plus
    the query head scales of layers that have any."""
    rank = {f.layer: f.rank for f in state.fits}
    total = sum(int(np.asarray(q).nbytes) for q in state.query_scales if np.any(q != 1))
    for layer, d in enumerate(state.deltas):
        if bool(jnp.any(d != 0)):
            r = rank.get(layer)
            total += int(d.nbytes) if r is None else r * sum(d.shape) * d.dtype.itemsize
    return total


def _valid_rows(a: jax.Array, lengths: np.ndarray) -> np.ndarray:
    """Flatten [P, m, ...] to the real tokens' rows [N, ...] (float64)."""
    a = np.asarray(a, np.float64)
    mask = np.arange(a.shape[1])[None, :] < lengths[:, None]
    return a[mask]


def fit_patches(model: Model, probed: ProbedContext, *, states: tuple | None = None,
                ridge_config: ridge.RidgeConfig = ridge.RidgeConfig(),
                sequential: bool = True, target: str = "attention",
                layers: Sequence[int] | None = None,
                strengths: Sequence[float] = (),
                query_scales: Sequence[float] = ()) -> PatchState:
    """Fit the per-layer patches of `model` (whose caches compress) for a probed context.

    states: the context's cache states as `model` prefilled them (batch = contexts, at
      least `probed.max_len` slots); prefilled here when None.
    strengths: global scales of the whole patch that compete on the held-out probe rows by
      the model's own objective, KL(full-cache reference || patched compressed model) of
      the next-token distributions (0, the unpatched model, is always a candidate). The
      per-layer penalties are chosen on attention outputs; this guards the end result,
      where small per-layer gains can still add up to a worse model (seen with 1-bit
      caches). Empty: strength 1, no check.
    query_scales: candidate W_q scales, one for every query head of every layer (also
      those `layers` leaves out; 1 always competes), chosen on the held-out rows by the
      same KL before any W_o patch is fit (see the module docstring); empty: W_q is left
      alone.
    """
    _validate(model, probed, target, layers)
    _validate_strengths(strengths, probed)
    _validate_query_scales(query_scales, probed)
    t0 = time.perf_counter()
    c, probes = model.config, probed.probes
    if states is None:
        _, states = prefill_batch(model, probed.tokens, probed.lengths, probed.max_len)
    start = jnp.asarray(probed.lengths[probes.context], jnp.int32)
    n_new = jnp.asarray(probes.lengths, jnp.int32)
    holdout = np.repeat(probes.holdout, probes.lengths)
    to_fit = set(range(c.n_layers) if layers is None else layers)
    # one held-out setup (reference log-probs, tiled caches) serves both choices below
    held_out_kl = _held_out_kl(model, probed, states) if strengths or query_scales else None
    scales, scale_kls = [], ()
    if query_scales:  # chosen first, so the W_o patches are fit on the sharpened model
        scale, scale_kls = select_query_scale(model, probed, states, query_scales,
                                              held_out_kl)
        scales = _uniform_scales(model, scale)
        model = model.replace(params=patched_params(model, _no_deltas(model), scales))
    x_cmp = probed.reference.hidden[0]
    deltas, fits = [], []
    for layer in range(c.n_layers):
        x_ref = probed.reference.hidden[layer]
        x_in = x_cmp if sequential else x_ref
        s_cmp = tile_states(states[layer:layer + 1], probes.context)[0]
        view = layerwise.layer_view(model, layer)
        x_out, cap = layerwise.run_layer(view, x_in, start, n_new, s_cmp)
        o_cmp, o_ref = cap["attn"], probed.reference.captures[layer]["attn"]
        delta = jnp.zeros(model.params["layers"][layer]["wo"].shape, jnp.float32)
        if layer in to_fit:
            drift = x_ref - x_in if target == "residual" else None
            fit_delta, fit = _fit_layer(model, layer, o_cmp, o_ref, drift,
                                        probes.lengths, holdout, ridge_config)
            fits.append(fit)
            if np.any(fit_delta):
                delta = jnp.asarray(fit_delta, jnp.float32)
                if sequential:  # the next layer sees this layer patched
                    wo = patched_params(view, [delta])["layers"][0]["wo"]
                    x_out = layerwise.finish_layer(view, x_in, o_cmp, wo)
        deltas.append(delta)
        x_cmp = x_out
    strength, kls = 1.0, ()
    if strengths:
        strength, kls = select_strength(model, probed, states, deltas, strengths,
                                        held_out_kl)
        deltas = [d * strength for d in deltas]
    jax.block_until_ready(deltas)
    return PatchState(tuple(deltas), tuple(fits), time.perf_counter() - t0, probed.seconds,
                      probes.n_tokens, strength, kls, tuple(scales), scale_kls)


def select_query_scale(model: Model, probed: ProbedContext, states: tuple,
                       grid: Sequence[float], held_out_kl=None) -> tuple[float, tuple]:
    """The W_q scale t of every query head (1 always included) minimising the mean
    per-token KL(reference || model with W_q * t) on the held-out probe rows; returns
    (t, ((t, kl), ...)). held_out_kl: a `_held_out_kl` of the same context to reuse."""
    held_out_kl = held_out_kl or _held_out_kl(model, probed, states)
    no_deltas = _no_deltas(model)
    kls = tuple((t, held_out_kl(patched_params(model, no_deltas, _uniform_scales(model, t))))
                for t in sorted({1.0, *map(float, grid)}))
    return min(kls, key=lambda t: t[1])[0], kls


def _uniform_scales(model: Model, scale: float) -> list:
    """The same W_q scale for every query head of every layer."""
    return [np.full(model.config.n_heads, scale, np.float32)] * model.config.n_layers


def _no_deltas(model: Model) -> list:
    return [jnp.zeros(p["wo"].shape, jnp.float32) for p in model.params["layers"]]


def select_strength(model: Model, probed: ProbedContext, states: tuple, deltas: Sequence,
                    strengths: Sequence[float], held_out_kl=None) -> tuple[float, tuple]:
    """The scale s of the patch (0 always included) minimising the mean per-token
    KL(reference || model with W_o + s * Delta) on the held-out probe rows; returns (s,
    ((s, kl), ...)). held_out_kl: a `_held_out_kl` of the same context to reuse."""
    held_out_kl = held_out_kl or _held_out_kl(model, probed, states)
    kls = tuple((s, held_out_kl(patched_params(model, [d * s for d in deltas])))
                for s in sorted({0.0, *map(float, strengths)}))
    return min(kls, key=lambda t: t[1])[0], kls


def _held_out_kl(model: Model, probed: ProbedContext, states: tuple):
    """params -> mean per-token KL(full-cache reference || `model` with those params) of
    the next-token distributions on the held-out probe rows, over the compressed `states`.
    `params` are complete (embeddings included), so the closure serves any patch of
    `model`, W_q-scaled or not."""
    probes = probed.probes
    rows = np.flatnonzero(probes.holdout)
    tokens = jnp.asarray(probes.tokens[rows])
    n_new = jnp.asarray(probes.lengths[rows], jnp.int32)
    start = jnp.asarray(probed.lengths[probes.context[rows]], jnp.int32)
    # the reference pass already ran these rows through the full cache: unembed its output
    ref_logp = jax.nn.log_softmax(unembed(model, probed.reference.hidden[-1][rows]), axis=-1)
    cmp_states = tile_states(states, probes.context[rows])
    valid = jnp.arange(tokens.shape[1])[None, :] < n_new[:, None]

    def kl(params) -> float:
        logp = _log_probs(model.replace(params=params), tokens, start, n_new, cmp_states)
        per_token = jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp), axis=-1)
        return float(jnp.sum(jnp.where(valid, per_token, 0.0)) / jnp.sum(valid))

    return kl


def _log_probs(model, tokens, start, n_new, states):
    logits, _ = session.query_forward(model, tokens, start, n_new, states)
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def _validate_strengths(strengths, probed):
    if any(not (isinstance(s, (int, float)) and 0.0 <= s and np.isfinite(s))
           for s in strengths):
        raise ValueError(f"strengths must be finite scales >= 0, got {tuple(strengths)}")
    if strengths and not probed.probes.holdout.any():
        raise ValueError("strengths are chosen on held-out probe rows: set "
                         "ProbeConfig.holdout > 0 (with at least two probe rows)")


def _fit_layer(model, layer, o_cmp, o_ref, drift, lengths, holdout, config):
    with ridge.single_blas_thread():
        return _fit_layer_rows(model, layer, o_cmp, o_ref, drift, lengths, holdout, config)


def _fit_layer_rows(model, layer, o_cmp, o_ref, drift, lengths, holdout, config):
    wo = np.asarray(model.params["layers"][layer]["wo"], np.float64)
    x = _valid_rows(o_cmp, lengths)
    y = _valid_rows(o_ref, lengths) @ wo - x @ wo
    if drift is not None:
        y = y + _valid_rows(drift, lengths)
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise FloatingPointError(f"layer {layer}: probe attention outputs are not finite")
    use_holdout = holdout if config.selection == "holdout" else None
    fit = ridge.fit_ridge(x, y, use_holdout, config)
    return fit.delta, LayerFit(layer, fit.alpha, fit.lam, fit.train_rel_err, fit.val_rel_err,
                               fit.rank)


def _validate_query_scales(query_scales, probed):
    if any(not (isinstance(t, (int, float)) and 0.0 < t and np.isfinite(t))
           for t in query_scales):
        raise ValueError(f"query_scales must be finite scales > 0, got {tuple(query_scales)}")
    if query_scales and not probed.probes.holdout.any():
        raise ValueError("query_scales are chosen on held-out probe rows: set "
                         "ProbeConfig.holdout > 0 (with at least two probe rows)")


def _validate(model, probed, target, layers):
    if not isinstance(probed, ProbedContext):
        raise TypeError(f"probed must be a ProbedContext (research.patchkv.probes."
                        f"probe_context), got {type(probed).__name__}")
    if len(probed.reference.captures) != model.config.n_layers:
        raise ValueError(f"probed context has {len(probed.reference.captures)} layers, the "
                         f"model {model.config.n_layers}")
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if layers is not None:
        bad = [i for i in layers if not 0 <= i < model.config.n_layers]
        if bad:
            raise ValueError(f"layers {bad} out of range [0, {model.config.n_layers})")


def patchkv(*, probes: ProbeConfig = ProbeConfig(),
            ridge_config: ridge.RidgeConfig = ridge.RidgeConfig(), sequential: bool = True,
            target: str = "attention", layers: Sequence[int] | None = None,
            strengths: Sequence[float] = (), query_scales: Sequence[float] = ()) -> Transform:
    """Transform: calibrate on the context (CalibrationData), return the patched model.

    strengths, query_scales: see `fit_patches`; the experiments use DEV_STRENGTHS (chosen
    on a dev split), which also lets the held-out probes switch a harmful patch off, and
    DEV_QUERY_SCALES on quantised caches.

    Prefill the context with the model *before* this transform (it builds the compressed
    cache); serve queries with the patched model (see the module docstring).
    """
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if not isinstance(probes, ProbeConfig):
        raise TypeError(f"probes must be a ProbeConfig, got {type(probes).__name__}")

    def calibrate(model, data):
        return fit_patches(model, probe_context(model, data, probes),
                           ridge_config=ridge_config, sequential=sequential, target=target,
                           layers=layers, strengths=strengths, query_scales=query_scales)

    def apply(model, state):
        if not isinstance(state, PatchState):
            raise TypeError(f"patchkv state must be a PatchState, got {type(state).__name__}")
        return apply_patch(model, state)

    name = (f"patchkv({'seq' if sequential else 'indep'},{target},{ridge_config.selection}"
            f"{',query_scale' if query_scales else ''})")
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
            "mean_rank": mean([f.rank if f.rank is not None else min(state.deltas[f.layer].shape)
                               for f in fits if np.isfinite(f.alpha)]),
            "strength": state.strength,
            "query_scale": (float(np.mean(state.query_scales)) if state.query_scales
                            else 1.0),
            "query_scale_kl": [list(t) for t in state.query_scale_kl],
            "strength_kl": [list(t) for t in state.strength_kl],
            "patch_bytes": patch_nbytes(state), "fit_seconds": state.fit_seconds,
            "probe_seconds": state.probe_seconds, "probe_tokens": state.n_probe_tokens}

