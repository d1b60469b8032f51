"""Cache-side baselines at the same budget: refit what the kept slots hold, per context.

Both start from an evicting cache's kept slots (same policy, same budget, same context)
and use the same probe queries as PatchKV (taken from the full-cache reference model),
fitting each layer and KV head so that attention over the kept slots, together with the
query's own new tokens, reproduces the reference attention output:

* "grkv" (GRKV-style ridge merge, Peng et al. 2026): the information of evicted tokens
  is distributed over the kept values by a ridge regression on the value *updates*,
  dV = argmin ||A_kept dV - (o_ref - o_cmp)||^2 + lam ||dV||^2, lam chosen on held-out
  probes like PatchKV's. Keys are unchanged. (The paper's span-aware anchors and
  iterative steps are not reproduced; this is its global ridge objective.)
* "am" (Attention-Matching-style compaction, Zweiger et al. 2025): first a per-slot
  logit bias beta = log w, w >= 0 fit by non-negative least squares so that the kept
  keys carry the full context's attention mass (sum_j w_j exp(q.k_j) ~ sum_i exp(q.k_i)),
  then the kept values by (nearly unregularised) least squares under the new weights.

The result is new cache states (values, and biases for "am"); the weights are untouched
and the context's memory is unchanged. As transforms (`grkv()`, `am()`: per-context, like
`patchkv()`; research/transforms.py) they return a model whose evicting caches are wrapped
in a `RefitKVCache`: prefilling *that* context stores the refit values, so
`chain(evict(...), grkv(), patchkv())` fits the patch over the refit cache.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Float
from scipy.optimize import nnls

from research.eviction.press import EvictingKVCache, is_evicting
from research.kv.base import KVCache
from research.model.llama import Model
from research.patchkv import ridge
from research.patchkv.probes import ProbeConfig, ProbedContext, as_probed
from research.patchkv.session import prefill_batch
from research.transforms import Transform

METHODS = ("grkv", "am")
AM_RIDGE = ridge.RidgeConfig(selection="fixed", alpha=1e-6, allow_zero=False)
MASS_ROWS = 2048
BIAS_FLOOR = 1e-8  # w below this is a dropped slot: beta = log(1e-8) ~ -18


def refit_values(model: Model, states: tuple, probed: ProbedContext, *, method: str,
                 ridge_config: ridge.RidgeConfig = ridge.RidgeConfig()) -> tuple:
    """New evicting cache `states` (the contexts of `probed`, as `model` prefilled them)
    with refit values (and biases for "am")."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    c, probes = model.config, probed.probes
    new_states = []
    for layer, state in enumerate(states):
        if not is_evicting(state):
            raise TypeError(f"layer {layer}: value refits need an evicting cache state "
                            "(chain evict(...) first)")
        cap = {k: np.asarray(a, np.float64)
               for k, a in probed.reference.captures[layer].items()}
        v = np.array(state["v"], np.float64)
        bias = np.array(state["bias"], np.float64)
        full_k = np.asarray(probed.ref_states[layer]["k"], np.float64)
        with ridge.single_blas_thread():
            _refit_layer(cap, state, v, bias, full_k, probed, c, method, ridge_config)
        new_states.append({**state, "v": jnp.asarray(v, state["v"].dtype),
                           "bias": jnp.asarray(bias, jnp.float32)})
    return tuple(new_states)


def _refit_layer(cap, state, v, bias, full_k, probed, c, method, ridge_config):
    """Refit one layer's kept values (and biases) in place, per context and KV head."""
    probes = probed.probes
    for b in range(v.shape[0]):
        rows = np.flatnonzero(probes.context == b)
        for h in range(c.n_kv_heads):
            slots = np.flatnonzero(np.asarray(state["pos"][b, :, h]) >= 0)
            problem = _head_problem(cap, rows, probes, h, c.q_per_kv,
                                    np.asarray(state["k"][b, slots, h], np.float64),
                                    v[b, slots, h], full_k[b, :probed.lengths[b], h])
            new_v, new_bias = _solve_head(problem, method, ridge_config)
            v[b, slots, h] = new_v
            bias[b, slots, h] = new_bias


def _head_problem(cap, rows, probes, h, g, k_kept, v_kept, k_full) -> dict:
    """Logits [P, m, G, ...] of one KV head's probe queries over kept / own / full keys."""
    d = k_kept.shape[-1]
    q = cap["q"][rows][:, :, h * g:(h + 1) * g]  # [P, m, G, D]
    m = q.shape[1]
    valid_q = np.arange(m)[None, :] < probes.lengths[rows][:, None]  # [P, m]
    own_mask = np.tril(np.ones((m, m), bool))[None] & valid_q[:, None, :]  # [P, t, u]
    scale = 1.0 / math.sqrt(d)
    s_own = np.einsum("ptgd,pud->ptgu", q, cap["k"][rows][:, :, h]) * scale
    return {"s_kept": np.einsum("ptgd,sd->ptgs", q, k_kept) * scale,
            "s_own": np.where(own_mask[:, :, None, :], s_own, -np.inf),
            "s_full": np.einsum("ptgd,sd->ptgs", q, k_full) * scale,
            "v_own": cap["v"][rows][:, :, h],  # [P, m, D]
            "o_ref": cap["attn"][rows].reshape(*q.shape[:2], -1, d)[:, :, h * g:(h + 1) * g],
            "v_kept": v_kept,
            "rows": np.broadcast_to(valid_q[:, :, None], q.shape[:3]),  # real query rows
            "holdout": np.broadcast_to(probes.holdout[rows][:, None, None], q.shape[:3])}


def _softmax_parts(s_kept, s_own, bias):
    """Attention weights over kept slots (with bias) and own tokens, jointly normalised."""
    logits_kept = s_kept + bias
    top = np.maximum(np.max(logits_kept, axis=-1), np.max(s_own, axis=-1))[..., None]
    a_kept = np.exp(logits_kept - top)
    a_own = np.exp(s_own - top)  # exp(-inf) = 0 for masked own tokens
    z = a_kept.sum(-1, keepdims=True) + a_own.sum(-1, keepdims=True)
    return a_kept / z, a_own / z


def _solve_head(pb: dict, method: str, config: ridge.RidgeConfig):
    rows = pb["rows"]
    bias = np.zeros(pb["v_kept"].shape[0])
    if method == "am":
        bias = _mass_bias(pb["s_kept"][rows], pb["s_full"][rows])
        config = AM_RIDGE
    w_kept, w_own = _softmax_parts(pb["s_kept"], pb["s_own"], bias)
    own_part = np.einsum("ptgu,pud->ptgd", w_own, pb["v_own"])
    target = (pb["o_ref"] - own_part)[rows] - w_kept[rows] @ pb["v_kept"]
    holdout = pb["holdout"][rows] if config.selection == "holdout" else None
    fit = ridge.fit_ridge(w_kept[rows], target, holdout, config)
    return pb["v_kept"] + fit.delta, bias


def _mass_bias(s_kept, s_full):
    """beta = log w, w >= 0 with sum_j w_j exp(s_kept_j) ~ sum_i exp(s_full_i) per query
    (on at most MASS_ROWS evenly spaced query rows: NNLS cost grows with the rows)."""
    step = max(1, -(-s_kept.shape[0] // MASS_ROWS))
    s_kept, s_full = s_kept[::step], s_full[::step]
    top = np.max(s_full, axis=1, keepdims=True)
    e = np.exp(s_kept - top)
    z = np.exp(s_full - top).sum(1)
    w, _ = nnls(e, z, maxiter=50 * e.shape[1])
    return np.log(np.maximum(w, BIAS_FLOOR))



@struct.dataclass
class RefitKVCache(KVCache):
    """An evicting cache that stores one context's refit values (and logit biases) when it
    prefills that context: the per-context cache of a GRKV / AM refit.

    Eviction picks the same slots for the same context, so the refit arrays (made from a
    prefill of it) land on the slots they were fit for. Only a context chunk (start 0,
    more than one token, a batch of as many rows as the refit contexts) is rewritten;
    queries and decode steps append as `inner` does. It serves the context(s) it was fit
    on, like a PatchKV patch.
    """

    inner: EvictingKVCache
    v: Float[Array, "B S Hkv D"]  # the context's values, kept slots refit
    bias: Float[Array, "B S Hkv"]  # the kept slots' logit biases (0 for "grkv")

    def init(self, batch, max_len, n_kv_heads, head_dim):
        return self.inner.init(batch, max_len, n_kv_heads, head_dim)

    def update_and_attend(self, state, q, k, v, *, start, n_new, window):
        out, new = self.inner.update_and_attend(state, q, k, v, start=start, n_new=n_new,
                                                window=window)
        if q.shape[1] == 1 or new["v"].shape[0] != self.v.shape[0]:
            # a decode step, or a batch of query rows over tiled context caches (as the
            # patch fits run them): no row is a prefill of the refit context(s)
            return out, new
        m = min(new["v"].shape[1], self.v.shape[1])
        is_context = (start == 0)[:, None, None]
        refit_v = jnp.where(is_context[..., None], self.v[:, :m].astype(new["v"].dtype),
                            new["v"][:, :m])
        refit_bias = jnp.where(is_context, self.bias[:, :m], new["bias"][:, :m])
        return out, {**new, "v": new["v"].at[:, :m].set(refit_v),
                     "bias": new["bias"].at[:, :m].set(refit_bias)}

    def capacity(self, max_len):
        return self.inner.capacity(max_len)

    def describe(self):
        return f"refit[{self.inner.describe()}]"


def value_refit(method: str, *, probes: ProbeConfig = ProbeConfig(),
                ridge_config: ridge.RidgeConfig = ridge.RidgeConfig(),
                probe_text=None) -> Transform:
    """Transform (per context): refit the kept values (and AM biases) of the incoming
    model's evicting caches for the context it calibrates on (a CalibrationData of it, or
    a ProbedContext built with `probes`); the model it returns prefills that context into
    the refit cache. method: "grkv" or "am" (module docstring)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(probes, ProbeConfig):
        raise TypeError(f"probes must be a ProbeConfig, got {type(probes).__name__}")

    def calibrate(model, data):
        probed = as_probed(model, data, probes, probe_text)
        _, states = prefill_batch(model, probed.tokens, probed.lengths, probed.max_len)
        new = refit_values(model, states, probed, method=method, ridge_config=ridge_config)
        return tuple((s["v"], s["bias"]) for s in new)

    def apply(model, state):
        if len(state) != len(model.caches):
            raise ValueError(f"{method} state has {len(state)} layers, the model "
                             f"{len(model.caches)}")
        caches = []
        for i, (cache, (v, bias)) in enumerate(zip(model.caches, state)):
            if not isinstance(cache, EvictingKVCache):
                raise TypeError(f"{method}: layer {i} has a {cache.describe()} cache; value "
                                "refits need an evicting cache (chain evict(...) first)")
            caches.append(RefitKVCache(inner=cache, v=v, bias=bias))
        return model.replace(caches=tuple(caches), tags=model.tags + (method,))

    return Transform(calibrate, apply, method)


def grkv(**kwargs) -> Transform:
    """GRKV-style ridge merge as a per-context transform (`value_refit("grkv", ...)`)."""
    return value_refit("grkv", **kwargs)


def am(**kwargs) -> Transform:
    """Attention-Matching-style compaction as a per-context transform
    (`value_refit("am", ...)`)."""
    return value_refit("am", **kwargs)
