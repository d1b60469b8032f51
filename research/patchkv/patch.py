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

FFN patch (`ffn=True`): after layer l's W_o patch, a second closed-form ridge patch of
the dense FFN's down projection W_down [F, D], whose input, the SwiGLU hidden
activations, is a nonlinear function of the whole residual stream (the query's own
identity included), not only of the attention output over the compressed cache. Its
target is the rest of the layer's mismatch: the reference stream's output minus the
compressed stream's output with the W_o patch in (drift from lower layers included). The
same penalty choice, strength and zero-cost folding apply (W_down + Delta, same shapes).

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

import functools
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from research.model.llama import Model, unembed
from research.patchkv import layerwise, ridge, session
from research.patchkv.probes import (ProbeConfig, ProbedContext, as_probed,  # noqa: F401
                                     probe_context, reference_model)
from research.patchkv.session import prefill_batch, tile_states
from research.transforms import Transform

TARGETS = ("attention", "residual")
DEV_STRENGTHS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)  # experiments/patchkv/README.md
DEV_QUERY_SCALES = (0.9, 1.1, 1.2, 1.3, 1.4)  # quantised caches (same README)


class LowRank(NamedTuple):
    """A patch stored as its two factors, delta = left @ right: r (d_in + d_out) numbers
    instead of d_in d_out. Folded into the weight when applied (`dense`), so the patched
    model's shapes and FLOPs are the unpatched one's; only the per-context storage shrinks.
    """

    left: jax.Array  # [d_in, r]
    right: jax.Array  # [r, d_out]

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.left.shape[0]), int(self.right.shape[1]))

    @property
    def rank(self) -> int:
        return int(self.left.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of the two stored arrays."""
        return int(self.left.nbytes) + int(self.right.nbytes)

    def dense(self) -> jax.Array:
        """The [d_in, d_out] delta in f32."""
        return self.left.astype(jnp.float32) @ self.right.astype(jnp.float32)

    @classmethod
    def from_dense(cls, delta, rank: int | None = None, dtype=jnp.float32) -> "LowRank":
        """Factors of `delta` by SVD, truncated to `rank` (None: min(d_in, d_out), exact up
        to float rounding); the singular values go into the left factor."""
        delta = np.asarray(delta, np.float64)
        if delta.ndim != 2:
            raise ValueError(f"delta must be 2-D [d_in, d_out], got shape {delta.shape}")
        full = min(delta.shape)
        rank = full if rank is None else rank
        if not (isinstance(rank, (int, np.integer)) and 1 <= rank <= full):
            raise ValueError(f"rank must be an int in [1, {full}] for a {delta.shape} "
                             f"delta, got {rank!r}")
        u, sv, vt = np.linalg.svd(delta, full_matrices=False)
        return cls(jnp.asarray(u[:, :rank] * sv[:rank], dtype), jnp.asarray(vt[:rank], dtype))


def dense(delta) -> jax.Array:
    """A stored patch (dense array or LowRank) as a dense f32 [d_in, d_out] array."""
    return delta.dense() if isinstance(delta, LowRank) else jnp.asarray(delta, jnp.float32)


def scale_patch(delta, s: float):
    """s times a stored patch, in its storage (a LowRank scales its left factor)."""
    if isinstance(delta, LowRank):
        return LowRank((delta.left.astype(jnp.float32) * s).astype(delta.left.dtype),
                       delta.right)
    return (delta * s).astype(delta.dtype)


def cast_patch(delta, dtype):
    """A stored patch with its arrays in `dtype` (e.g. bfloat16 storage)."""
    if isinstance(delta, LowRank):
        return LowRank(delta.left.astype(dtype), delta.right.astype(dtype))
    return jnp.asarray(delta).astype(dtype)


def stored_nbytes(delta) -> int:
    """Bytes of a stored patch's arrays (0 for an all-zero patch, which is not stored)."""
    if not is_nonzero(delta):
        return 0
    return delta.nbytes if isinstance(delta, LowRank) else int(jnp.asarray(delta).nbytes)


def is_nonzero(delta) -> bool:
    leaves = (delta.left,) if isinstance(delta, LowRank) else (delta,)
    return any(bool(jnp.any(a != 0)) for a in leaves)


class LayerFit(NamedTuple):
    layer: int
    alpha: float  # chosen relative penalty (inf = left unpatched)
    lam: float
    train_rel_err: tuple[float, float]  # attention-contribution error before / after
    val_rel_err: tuple[float, float]  # same on held-out probe rows
    rank: int | None = None  # reduced rank of the patch (None: full rank)


class PatchState(NamedTuple):
    """Transform state: one [Hq*Dh, D] delta per layer (zeros where unpatched; a LowRank
    pair of factors where the fit's rank was reduced) + report."""

    deltas: tuple  # already multiplied by `strength`; dense arrays or LowRank
    fits: tuple  # LayerFit per layer (host-side diagnostics)
    fit_seconds: float  # compressed prefill (if needed) + layer-by-layer fitting
    probe_seconds: float  # reference prefill + probes + reference pass (shared)
    n_probe_tokens: int
    strength: float = 1.0  # global scale chosen on held-out probe rows (0 = no patch)
    strength_kl: tuple = ()  # (strength, held-out KL(reference || patched)) per candidate
    query_scales: tuple = ()  # per layer [Hq] W_q head scales; () = W_q untouched
    query_scale_kl: tuple = ()  # (scale, held-out KL) per candidate query scale
    ffn_deltas: tuple = ()  # per layer [F, D] W_down delta (times `strength`, dense or
    # LowRank); () = none
    ffn_fits: tuple = ()  # LayerFit of the W_down patch per fitted layer


def patched_params(model: Model, deltas: Sequence, query_scales: Sequence = (),
                   ffn_deltas: Sequence = ()) -> dict:
    """Params with W_o + delta per layer and, if given, W_q's head columns scaled and
    W_down + ffn delta."""
    layers = model.params["layers"]
    for name, per_layer in (("patch", deltas), ("query_scales", query_scales),
                            ("ffn_deltas", ffn_deltas)):
        if (per_layer or name == "patch") and len(per_layer) != len(layers):
            raise ValueError(f"{name} has {len(per_layer)} layers, model has {len(layers)}")
    new_layers = []
    for i, (p, d) in enumerate(zip(layers, deltas)):
        new = {**p, "wo": _plus(p["wo"], d, f"layer {i}: patch", "wo")}
        if query_scales:
            new["wq"] = scaled_wq(p["wq"], query_scales[i], model.config.head_dim)
        if ffn_deltas:
            new["w_down"] = _plus(p["w_down"], ffn_deltas[i], f"layer {i}: ffn patch",
                                  "w_down")
        new_layers.append(new)
    return {**model.params, "layers": tuple(new_layers)}


def _plus(w: jax.Array, delta, what: str, name: str) -> jax.Array:
    """w + delta (dense or LowRank) in f32, back in w's dtype."""
    if tuple(delta.shape) != tuple(w.shape):
        raise ValueError(f"{what} shape {tuple(delta.shape)} != {name} shape {w.shape}")
    return (w.astype(jnp.float32) + dense(delta)).astype(w.dtype)


def scaled_wq(wq: jax.Array, head_scales, head_dim: int) -> jax.Array:
    """W_q [D, Hq*Dh] with each query head's columns times its scale [Hq]."""
    scales = jnp.repeat(jnp.asarray(head_scales, jnp.float32), head_dim)
    if scales.shape != wq.shape[-1:]:
        raise ValueError(f"head scales {np.shape(head_scales)} do not match wq {wq.shape} "
                         f"with head_dim={head_dim}")
    return (wq.astype(jnp.float32) * scales).astype(wq.dtype)


def apply_patch(model: Model, state: PatchState) -> Model:
    return model.replace(params=patched_params(model, state.deltas, state.query_scales,
                                               state.ffn_deltas),
                         tags=model.tags + ("patchkv",))


def patch_nbytes(state: PatchState) -> int:
    """Bytes of the arrays a server stores per context for this patch: each non-zero layer
    patch (W_o and W_down) as the state holds it (a dense delta, or a LowRank's two
    factors [d_in, r] and [r, d_out], in their dtype), plus the query head scales of
    layers that have any. All-zero (unpatched) layers are not stored."""
    total = sum(int(np.asarray(q).nbytes) for q in state.query_scales if np.any(q != 1))
    return total + sum(stored_nbytes(d) for d in state.deltas + state.ffn_deltas)


def cast_state(state: PatchState, dtype) -> PatchState:
    """The patch stored in `dtype` (e.g. jnp.bfloat16: half the bytes); applied in f32."""
    return state._replace(deltas=tuple(cast_patch(d, dtype) for d in state.deltas),
                          ffn_deltas=tuple(cast_patch(d, dtype) for d in state.ffn_deltas))


def _stored(fit: ridge.RidgeFit):
    """A ridge fit's delta as stored: its factors (f32) when the rank was reduced, else
    the dense f32 delta."""
    if fit.factors is not None:
        return LowRank(*(jnp.asarray(a, jnp.float32) for a in fit.factors))
    return jnp.asarray(fit.delta, jnp.float32)


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
                query_scales: Sequence[float] = (), ffn: bool = False) -> PatchState:
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
    ffn: also patch each fitted layer's W_down (dense FFN layers only; module docstring).
    """
    _validate(model, probed, target, layers, ffn)
    _validate_strengths(strengths, probed)
    _validate_query_scales(query_scales, probed)
    t0 = time.perf_counter()
    c, probes = model.config, probed.probes
    if states is None:
        _, states = prefill_batch(model, probed.tokens, probed.lengths, probed.max_len)
    to_fit = set(range(c.n_layers) if layers is None else layers)
    # one held-out setup (reference log-probs, tiled caches) serves both choices below
    held_out_kl = _held_out_kl(model, probed, states) if strengths or query_scales else None
    scales, scale_kls = [], ()
    if query_scales:  # chosen first, so the W_o patches are fit on the sharpened model
        scale, scale_kls = select_query_scale(model, probed, states, query_scales,
                                              held_out_kl)
        scales = _uniform_scales(model, scale)
        model = model.replace(params=patched_params(model, _no_deltas(model), scales))
    fitter = _LayerFitter(model, probed, states, ridge_config, target)
    x_cmp = probed.reference.hidden[0]
    deltas, fits, ffn_deltas, ffn_fits = [], [], [], []
    for layer in range(c.n_layers):
        x_in = x_cmp if sequential else probed.reference.hidden[layer]
        x_out, delta, fit, ffn_delta, ffn_fit = fitter.layer(layer, x_in, layer in to_fit,
                                                             ffn)
        deltas.append(delta)
        fits += [fit] if fit else []
        ffn_deltas += [ffn_delta] if ffn else []
        ffn_fits += [ffn_fit] if ffn_fit else []
        x_cmp = x_out
    strength, kls = 1.0, ()
    if strengths:
        strength, kls = select_strength(model, probed, states, deltas, strengths,
                                        held_out_kl, ffn_deltas)
        deltas = [scale_patch(d, strength) for d in deltas]
        ffn_deltas = [scale_patch(d, strength) for d in ffn_deltas]
    jax.block_until_ready((deltas, ffn_deltas))
    return PatchState(tuple(deltas), tuple(fits), time.perf_counter() - t0, probed.seconds,
                      probes.n_tokens, strength, kls, tuple(scales), scale_kls,
                      tuple(ffn_deltas), tuple(ffn_fits))


class _LayerFitter:
    """One layer's patches at a time, on the probe rows of one probed context."""

    def __init__(self, model, probed, states, ridge_config, target):
        probes = probed.probes
        self.model, self.probed, self.states = model, probed, states
        self.ridge_config, self.target = ridge_config, target
        self.start = jnp.asarray(probed.lengths[probes.context], jnp.int32)
        self.n_new = jnp.asarray(probes.lengths, jnp.int32)
        self.holdout = np.repeat(probes.holdout, probes.lengths)

    def layer(self, layer, x_in, fit_it, ffn):
        """(hidden after the layer with its patches in, W_o delta, its LayerFit or None,
        W_down delta or None, its LayerFit or None) for compressed-stream input x_in."""
        model, probed, probes = self.model, self.probed, self.probed.probes
        view = layerwise.layer_view(model, layer)
        x_out, cap = layerwise.run_layer_rows(view, x_in, self.start, self.n_new,
                                              self.states[layer], probes.context)
        o_cmp, o_ref = cap["attn"], probed.reference.captures[layer]["attn"]
        wo = view.params["layers"][0]["wo"]
        delta = jnp.zeros(wo.shape, jnp.float32)
        ffn_delta = (jnp.zeros(view.params["layers"][0]["w_down"].shape, jnp.float32)
                     if ffn else None)
        if not fit_it:
            return x_out, delta, None, ffn_delta, None
        drift = probed.reference.hidden[layer] - x_in if self.target == "residual" else None
        rows = functools.partial(_valid_rows, lengths=probes.lengths)
        y = (rows(o_ref) - rows(o_cmp)) @ np.asarray(wo, np.float64)
        fit_delta, fit = self._fit(layer, rows(o_cmp), y, drift)
        if np.any(fit_delta.delta):
            delta = _stored(fit_delta)
        if not ffn:  # the next layer sees this layer's W_o patched
            if np.any(fit_delta.delta):
                x_out = layerwise.finish_layer(view, x_in, o_cmp, wo + dense(delta))
            return x_out, delta, fit, None, None
        x_mid = x_in + o_cmp @ (wo + dense(delta))
        hidden = layerwise.ffn_hidden(view, x_mid)
        w_down = view.params["layers"][0]["w_down"]
        residual = probed.reference.hidden[layer + 1] - (x_mid + hidden @ w_down)
        ffn_fit_delta, ffn_fit = self._fit(layer, rows(hidden), rows(residual), None)
        if np.any(ffn_fit_delta.delta):
            ffn_delta = _stored(ffn_fit_delta)
        return (x_mid + hidden @ (w_down + dense(ffn_delta)), delta, fit, ffn_delta,
                ffn_fit)

    def _fit(self, layer, x, y, drift):
        """Ridge fit with x delta ~ y (+ drift) on the valid probe rows: (the ridge's
        RidgeFit, LayerFit); the RidgeFit carries the factors of a reduced-rank delta."""
        with ridge.single_blas_thread():
            return _fit_rows(layer, x, y, drift, self.probed.probes.lengths, self.holdout,
                             self.ridge_config)


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
                    strengths: Sequence[float], held_out_kl=None,
                    ffn_deltas: Sequence = ()) -> tuple[float, tuple]:
    """The scale s of the patch (0 always included) minimising the mean per-token
    KL(reference || model with W_o + s * Delta (and W_down + s * Delta_ffn)) on the
    held-out probe rows; returns (s, ((s, kl), ...)). held_out_kl: a `_held_out_kl` of the
    same context to reuse."""
    held_out_kl = held_out_kl or _held_out_kl(model, probed, states)
    kls = tuple((s, held_out_kl(patched_params(model, [scale_patch(d, s) for d in deltas],
                                               (), [scale_patch(d, s) for d in ffn_deltas])))
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
    valid = jnp.arange(tokens.shape[1])[None, :] < n_new[:, None]
    chunks = [slice(i, i + layerwise.ROW_CHUNK) for i in range(0, len(rows),
                                                              layerwise.ROW_CHUNK)]

    def kl(params) -> float:
        m, total = model.replace(params=params), 0.0
        for c in chunks:  # a chunk of rows at a time: each gathers its rows' caches
            logp = _log_probs(m, tokens[c], start[c], n_new[c],
                              tile_states(states, probes.context[rows][c]))
            per_token = jnp.sum(jnp.exp(ref_logp[c]) * (ref_logp[c] - logp), axis=-1)
            total += float(jnp.sum(jnp.where(valid[c], per_token, 0.0)))
        return total / float(jnp.sum(valid))

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


def _fit_rows(layer, x, y, drift, lengths, holdout, config):
    """Ridge fit of x delta ~ y (+ the drift rows) on the valid probe rows."""
    if drift is not None:
        y = y + _valid_rows(drift, lengths)
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise FloatingPointError(f"layer {layer}: probe activations are not finite")
    use_holdout = holdout if config.selection == "holdout" else None
    fit = ridge.fit_ridge(x, y, use_holdout, config)
    return fit, LayerFit(layer, fit.alpha, fit.lam, fit.train_rel_err, fit.val_rel_err,
                               fit.rank)


def _validate_query_scales(query_scales, probed):
    if any(not (isinstance(t, (int, float)) and 0.0 < t and np.isfinite(t))
           for t in query_scales):
        raise ValueError(f"query_scales must be finite scales > 0, got {tuple(query_scales)}")
    if query_scales and not probed.probes.holdout.any():
        raise ValueError("query_scales are chosen on held-out probe rows: set "
                         "ProbeConfig.holdout > 0 (with at least two probe rows)")


def _validate(model, probed, target, layers, ffn=False):
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
    moe = [i for i in (range(model.config.n_layers) if layers is None else layers)
           if model.config.is_moe(i)]
    if ffn and moe:
        raise ValueError(f"ffn=True patches a dense FFN's W_down; layers {moe} are MoE "
                         f"(leave them out with layers=...)")


def patchkv(*, probes: ProbeConfig = ProbeConfig(),
            ridge_config: ridge.RidgeConfig = ridge.RidgeConfig(), sequential: bool = True,
            target: str = "attention", layers: Sequence[int] | None = None,
            strengths: Sequence[float] = (), query_scales: Sequence[float] = (),
            ffn: bool = False, probe_text=None) -> Transform:
    """Transform: calibrate on the context (its CalibrationData, or a ProbedContext built
    with `probes`, shared by several methods), return the patched model.

    strengths, query_scales, ffn: see `fit_patches`; the experiments use DEV_STRENGTHS
    (chosen on a dev split), which also lets the held-out probes switch a harmful patch
    off, and ffn=True with text probe rows (DEV_QUERY_SCALES is an option for quantised
    caches; the dev split preferred the W_down patch).
    probe_text: 1-D token ids the probes' text rows come from (`probes.n_text > 0`; used
      when the data is a CalibrationData).

    Prefill the context with the model *before* this transform (it builds the compressed
    cache); serve queries with the patched model (see the module docstring).
    """
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if not isinstance(probes, ProbeConfig):
        raise TypeError(f"probes must be a ProbeConfig, got {type(probes).__name__}")

    def calibrate(model, data):
        return fit_patches(model, as_probed(model, data, probes, probe_text),
                           ridge_config=ridge_config, sequential=sequential, target=target,
                           layers=layers, strengths=strengths, query_scales=query_scales,
                           ffn=ffn)

    def apply(model, state):
        if not isinstance(state, PatchState):
            raise TypeError(f"patchkv state must be a PatchState, got {type(state).__name__}")
        return apply_patch(model, state)

    name = (f"patchkv({'seq' if sequential else 'indep'},{target},{ridge_config.selection}"
            f"{',query_scale' if query_scales else ''}{',ffn' if ffn else ''})")
    return Transform(calibrate, apply, name)


def summarize(state: PatchState) -> dict:
    """Mean train/held-out relative errors before/after, layers patched, bytes, times."""
    fits, ffn_fits = state.fits, state.ffn_fits
    mean = lambda xs: float(np.nanmean(xs)) if len(xs) else float("nan")  # noqa: E731
    return {"layers_patched": sum(1 for f in fits if np.isfinite(f.alpha)),
            "ffn_layers_patched": sum(1 for f in ffn_fits if np.isfinite(f.alpha)),
            "ffn_val_err_before": mean([f.val_rel_err[0] for f in ffn_fits]),
            "ffn_val_err_after": mean([f.val_rel_err[1] for f in ffn_fits]),
            "train_err_before": mean([f.train_rel_err[0] for f in fits]),
            "train_err_after": mean([f.train_rel_err[1] for f in fits]),
            "val_err_before": mean([f.val_rel_err[0] for f in fits]),
            "val_err_after": mean([f.val_rel_err[1] for f in fits]),
            "mean_rank": mean([f.rank if f.rank is not None else min(state.deltas[f.layer].shape)
                               for f in fits if np.isfinite(f.alpha)]),
            "max_rank": max([f.rank if f.rank is not None else min(state.deltas[f.layer].shape)
                             for f in fits + ffn_fits if np.isfinite(f.alpha)], default=0),
            "strength": state.strength,
            "query_scale": (float(np.mean(state.query_scales)) if state.query_scales
                            else 1.0),
            "query_scale_kl": [list(t) for t in state.query_scale_kl],
            "strength_kl": [list(t) for t in state.strength_kl],
            "patch_bytes": patch_nbytes(state), "fit_seconds": state.fit_seconds,
            "probe_seconds": state.probe_seconds, "probe_tokens": state.n_probe_tokens}

