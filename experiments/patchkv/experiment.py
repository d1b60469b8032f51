"""PatchKV vs no patch vs cache-side baselines (see patchkv.py for the command)."""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from experiments import common, protocol
from research import data
from research.eviction import POLICIES, evict, trim_states
from research.kv.base import state_nbytes
from research.model import load
from research.patchkv import (ContextCache, ProbeConfig, RidgeConfig, am, answer_queries,
                              attention_error, break_even_tokens, cache_nbytes, cast_state,
                              check_windows_in_split, continuation_tasks, decode_flops,
                              exact_match, grkv, param_shapes, patch_nbytes, patchkv,
                              prefill_batch, probe_context, reference_model, reply_prefix,
                              retrieval_task, score_continuations, split_range, summarize)
from research.decode.generate import default_stop_tokens
from research.tasq import TaSQConfig, tasq
from research.transforms import CalibrationData, Transform, calibrate_and_apply, chain, frozen

# the dev/test protocol (experiments/protocol.py)
TECHNIQUE = "patchkv"
DEFAULTS_CHOSEN_ON = (
    "python -m experiments.patchkv.dev.sweep; python -m experiments.patchkv.dev.retrieval "
    "(dev contexts, see patchkv.py); patch_rank: results/patchkv_4k_dev "
    "(experiments/patchkv/README.md)")


def defaults(config) -> dict:
    return {k: (config[k].to_dict() if hasattr(config[k], "to_dict") else config[k])
            for k in ("probes", "patch_ffn", "ridge_selection", "ridge_ranks", "patch_rank",
                      "patch_strengths", "patch_target", "quantizer_patch_target",
                      "quantizer_query_scales")} | {"retrieval_probes":
                                                    config.retrieval.probes.to_dict()}


def test_items(config) -> list:
    """The continuation windows (context + continuations) and retrieval contexts this run
    scores (the item ledger, experiments/protocol.py). A retrieval context's overlap is
    its document (filler prose and facts), not the fixed chat-template head."""
    tok = common.tokenizer_only(config.gguf_path or None)
    split_ids, token_range, n_text, text_name = evaluation_ids(tok, config)
    doc = f"{text_name} ({config.split})"
    items = []
    if config.continuation.n_contexts:
        cont = continuation_tasks(split_ids, **config.continuation.to_dict())
        items += protocol.text_windows(split_ids, [t.window for t in cont], doc)
    r = config.retrieval
    seed0 = config.seed + (0 if config.split == "test" else DEV_RETRIEVAL_SEEDS)
    head = tok.apply_chat_template([{"role": "user", "content": "X"}])
    head = head[:head.rindex("X")] + "Read the document and remember the access codes.\n\n"
    n_head = len(tok.encode(head))
    for i in range(r.n_contexts):
        t = retrieval_task(tok, split_ids, n_facts=r.n_facts, context_len=r.context_len,
                           seed=seed0 + i)
        items.append(protocol.window_item(
            t.context, f"retrieval context seed {seed0 + i} over {doc}", kind="context",
            overlap_ids=t.context[n_head:]))
    return items


TARGET_COMPRESSIONS = ("snapkv", "streaming_llm", "tasq-1bit")
TARGET_BUDGETS = (0.1, 0.25)
# The memory target (issue 28): the press at SMALL_BUDGET with its patch takes fewer total
# bytes (kept KV + patch) than the press alone at LARGE_BUDGET, with a lower perplexity.
SMALL_BUDGET, LARGE_BUDGET = 0.1, 0.25
KV_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}  # cache / patch storage accounted
# A method is a tuple of per-context steps chained after the press (research/transforms.py):
# () = the press alone ("none"); ("grkv", "patchkv") = the GRKV refit cache, then a
# PatchKV patch fit over it. Refits need evicted slots (eviction presses only); "patchkv",
# a weight patch, comes last: the context is prefilled by the model before it.
REFITS = {"grkv": grkv, "am": am}
STEPS = (*REFITS, "patchkv")
DEV_RETRIEVAL_SEEDS = 1000  # dev retrieval contexts use seeds 1000+ (test: 0+)


class Variant(dict):
    """model, states, fit_s, patch_bytes (and a PatchState summary) of one method."""

    @property
    def strength(self):
        """The patch strength chosen on held-out probes (None for non-patch methods)."""
        return self.get("summary", {}).get("strength")

    @property
    def query_scale(self):
        """The W_q scale chosen on held-out probes (1 = none; None for non-patch methods)."""
        return self.get("summary", {}).get("query_scale")


def method_name(steps: tuple) -> str:
    return "+".join(steps) or "none"


def check_method(steps) -> tuple:
    """A method's steps as a tuple of names from STEPS, with "patchkv" only last."""
    if isinstance(steps, str) or not isinstance(steps, (tuple, list)):
        raise TypeError(f"a method must be a tuple of steps from {STEPS}, e.g. () or "
                        f"('grkv', 'patchkv'), got {steps!r}")
    steps = tuple(steps)
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise ValueError(f"method {steps}: unknown steps {unknown}; expected some of {STEPS}")
    if "patchkv" in steps[:-1] or len(set(steps)) != len(steps):
        raise ValueError(f"method {steps}: each step at most once, 'patchkv' last")
    return steps


def press_transform(name: str, ratio: float) -> Transform:
    """An eviction press (a name in research.eviction.POLICIES) at `ratio`."""
    if name not in POLICIES:
        raise ValueError(f"compression {name!r} is not an eviction policy {sorted(POLICIES)}")
    return evict(name, ratio)


def method_transforms(steps, probes: ProbeConfig, ridge_cfg: RidgeConfig,
                      patch_kwargs: dict | None = None) -> tuple[Transform, ...]:
    """The per-context transforms of a method, in order."""
    return tuple(patchkv(probes=probes, ridge_config=ridge_cfg, **(patch_kwargs or {}))
                 if s == "patchkv" else REFITS[s](probes=probes, ridge_config=ridge_cfg)
                 for s in check_method(steps))


def make_variants(model, press: Transform, probed, methods, ridge_cfg, patch_kwargs=None,
                  bf16_rows: bool = False):
    """Each method's chain(press, *steps), calibrated on the probed context (the probes are
    shared) and applied to `model`, with the context's cache as it serves it: prefilled by
    the chain's model before the PatchKV patch. bf16_rows: also a "<method>@bf16" variant
    per patched method, its patch stored (and applied) in bfloat16."""
    out, cache_states = {}, {}
    for steps in map(check_method, methods):
        ts = method_transforms(steps, probed.config or ProbeConfig(), ridge_cfg,
                               patch_kwargs)
        t0 = time.perf_counter()
        served, states = calibrate_and_apply(chain(press, *ts), model, probed)
        fit_s = time.perf_counter() - t0 if steps else 0.0
        patched = steps[-1:] == ("patchkv",)
        before_patch = steps[:-1] if patched else steps
        if before_patch not in cache_states:
            n = 1 + len(before_patch)
            cache_model = chain(press, *ts[:n - 1]).apply(model, states[:n])
            cache_states[before_patch] = prefilled(cache_model, probed)[1]
        v = Variant(model=served, states=cache_states[before_patch], fit_s=fit_s,
                    patch_bytes=patch_nbytes(states[-1]) if patched else 0)
        if patched:
            v["summary"] = summarize(states[-1])
            # the same patch stored in bfloat16 (half the bytes), applied as stored
            half = states[:-1] + (cast_state(states[-1], jnp.bfloat16),)
            v["patch_bytes_bf16"] = patch_nbytes(half[-1])
        out[method_name(steps)] = v
        if patched and bf16_rows:
            out[method_name(steps) + "@bf16"] = Variant(
                model=chain(press, *ts).apply(model, half), states=cache_states[before_patch],
                fit_s=fit_s, patch_bytes=v["patch_bytes_bf16"], summary=v["summary"],
                patch_bytes_bf16=v["patch_bytes_bf16"])
    return out


def score_continuation(variant, length, task, full_contrib):
    ctx = ContextCache(variant["states"], length, None)
    s = score_continuations(variant["model"], ctx, task.continuations, attention=True)
    return {"nll_sum": s.nll * s.n_tokens, "n": s.n_tokens,
            "attn_err": attention_error(s.attn_contrib, full_contrib)}


def score_retrieval(variant, length, task, tok, max_new, stops):
    ctx = ContextCache(variant["states"], length, None)
    outs = answer_queries(variant["model"], ctx, task.questions,
                                  max_new_tokens=max_new, stop_tokens=stops)
    texts = [tok.decode(o, skip_special=True) for o in outs]
    correct = sum(exact_match(t, a) for t, a in zip(texts, task.answers))
    return {"correct": correct, "asked": len(task.answers), "samples": texts[:2]}


def press_states(model, press: Transform, probed):
    """(model with the press's caches, the context's states as it prefills them)."""
    return prefilled(calibrate_and_apply(press, model, probed)[0], probed)


def prefilled(compressed, probed):
    _, states = prefill_batch(compressed, probed.tokens, probed.lengths, probed.max_len)
    return compressed, states


def calibrate_quantizers(model, tok, config) -> dict[str, Transform]:
    """Quantizers are calibrated once per model on the calibration split (never on the
    evaluation contexts), then frozen; PatchKV is fitted per context on top of them."""
    out = {}
    for bits in config.quantizers:
        c = config.tasq
        cal = CalibrationData.from_corpus(tok, c.seq_len, c.n_seqs)
        t = tasq(TaSQConfig(bits=bits, kmeans_iters=c.kmeans_iters,
                            max_points=c.max_points, seed=config.seed))
        out[f"tasq-{bits}bit"] = frozen(t, t.calibrate(model, cal))
    return out


def probe_text(tok, config) -> np.ndarray:
    """The token pool of the probes' text rows: the calibration split after the slice the
    quantizers calibrate on (never the held-out text the tasks come from)."""
    skip = config.tasq.seq_len * config.tasq.n_seqs if config.quantizers else 0
    return np.asarray(tok.encode(data.corpus_text("calibration")), np.int32)[skip:]


def kv_kept_bytes(states, dtype=None):
    """Bytes of the context's cache arrays cut to the slots they use (evicting caches),
    as they are (dtype None) or cast to `dtype` (real cast arrays)."""
    trimmed = trim_states(states, room=0)
    return state_nbytes(trimmed) if dtype is None else cache_nbytes(trimmed, dtype)


def full_kv_bytes(states, length: int, dtype=None) -> int:
    """Bytes of a dense cache's arrays cut to the context's `length` slots (slot axis 1),
    as they are or cast to `dtype`."""
    return cache_nbytes(jax.tree.map(lambda a: a[:, :length], states), dtype)


def run_context(kind, model, tok, task, config, probe_cfg, ridge_cfg, quantizers, records,
                bar, index=0, text=None):
    """All compressions x budgets x methods on context `index` of its kind; appends raw
    records (each tagged with the context index). text: the probes' text-row pool."""
    first = len(records)
    probed = probe_context(model, CalibrationData.from_context(task.context), probe_cfg,
                           text)
    length = len(task.context)
    ref = reference_model(model)
    ref_variant = Variant(model=ref, states=probed.ref_states)
    if kind == "continuation":
        ctx = ContextCache(probed.ref_states, length, None)
        full = score_continuations(ref, ctx, task.continuations, attention=True)
        full_contrib = full.attn_contrib
        score = lambda v: score_continuation(v, length, task, full_contrib)  # noqa: E731
    else:
        stops = default_stop_tokens(tok)
        score = lambda v: score_retrieval(v, length, task, tok,  # noqa: E731
                                          config.retrieval.max_new_tokens, stops)
    records.append({"kind": kind, "compression": "full", "budget": 1.0, "method": "full",
                    "probe_s": probed.seconds, "context_tokens": length,
                    "kv_bytes": full_kv_bytes(probed.ref_states, length),
                    "kv_bytes_bf16": full_kv_bytes(probed.ref_states, length, jnp.bfloat16),
                    "cache_slots": int(probed.max_len), **score(ref_variant)})
    methods = [check_method(m) for m in config.methods]
    for name in config.compressions:
        for ratio in config.budgets:
            press = press_transform(name, ratio)
            kept_states = press_states(model, press, probed)[1]
            kept = kv_kept_bytes(kept_states)
            kept_bf16 = kv_kept_bytes(kept_states, jnp.bfloat16)
            del kept_states
            patched = tuple(config.get("patched_budgets", ()))
            budget_methods = [m for m in methods if not m or not patched or ratio in patched]
            for method, v in make_variants(model, press, probed, budget_methods, ridge_cfg,
                                           patch_kwargs(config, "eviction"),
                                           kind == "continuation").items():
                records.append(_record(kind, name, ratio, method, v, score, kv_bytes=kept,
                                       kv_bytes_bf16=kept_bf16,
                                       patch_bytes_bf16=v.get("patch_bytes_bf16", 0)))
            bar.update(1)
    # Value refits (grkv, am) need evicted slots: quantizers get the press alone / PatchKV.
    quantizer_methods = [m for m in methods if not set(m) & set(REFITS)]
    for name, quantizer in quantizers.items():
        kept_states = press_states(model, quantizer, probed)[1]
        kept = kv_kept_bytes(kept_states)
        kept_bf16 = kv_kept_bytes(kept_states, jnp.bfloat16)
        budget = kept / kv_kept_bytes(probed.ref_states)  # byte fraction vs the f32 cache
        for method, v in make_variants(model, quantizer, probed, quantizer_methods,
                                       ridge_cfg, patch_kwargs(config, "quantizer")).items():
            records.append(_record(kind, name, budget, method, v, score, kv_bytes=kept,
                                   kv_bytes_bf16=kept_bf16,
                                   patch_bytes_bf16=v.get("patch_bytes_bf16", 0)))
        bar.update(1)
    if kind == "continuation":
        run_ablations(model, config, probed, ridge_cfg, score, records)
    for rec in records[first:]:
        rec["context"] = index


def _record(kind, compression, budget, method, variant, score, **extra) -> dict:
    """One raw result: what was run, the fit's cost and the task score."""
    return {"kind": kind, "compression": compression, "budget": budget, "method": method,
            "fit_s": variant["fit_s"], "patch_bytes": variant["patch_bytes"],
            "rank": variant.get("summary", {}).get("max_rank"),
            "strength": variant.strength, "query_scale": variant.query_scale, **extra,
            **score(variant)}


def patch_kwargs(config, family: str) -> dict:
    """fit_patches options of the config for a cache family ("eviction" or "quantizer")."""
    if family not in ("eviction", "quantizer"):
        raise ValueError(f"family must be 'eviction' or 'quantizer', got {family!r}")
    quantizer = family == "quantizer"
    return {"target": config.quantizer_patch_target if quantizer else config.patch_target,
            "strengths": tuple(config.get("patch_strengths", ())),
            "query_scales": tuple(config.get("quantizer_query_scales", ())) if quantizer
            else (),
            "ffn": bool(config.get("patch_ffn", False))}


ABLATIONS = ("independent", "residual", "gcv", "rank<N>", "full_rank", "no_strength",
             "no_ffn")


def run_ablations(model, config, probed, ridge_cfg, score, records):
    """Variants of the default PatchKV on the first compression at its smallest budget:
    independent (teacher-forced) fitting, the residual target, GCV, patches capped at rank
    N ("rank<N>", e.g. "rank64"; stored as two factors) or uncapped ("full_rank", dense),
    no strength selection and no W_down patch (W_o only)."""
    name, ratio = config.compressions[0], min(config.budgets)
    press = press_transform(name, ratio)
    default = patch_kwargs(config, "eviction")
    kept = {}
    if config.ablations:  # the press's kept KV, for the bytes of each ablation's total
        kept_states = press_states(model, press, probed)[1]
        kept = {"kv_bytes": kv_kept_bytes(kept_states),
                "kv_bytes_bf16": kv_kept_bytes(kept_states, jnp.bfloat16)}
    options = {"independent": ({**default, "sequential": False}, ridge_cfg),
               "residual": ({**default, "target": "residual"}, ridge_cfg),
               "gcv": (default, RidgeConfig(selection="gcv")),
               "full_rank": (default, RidgeConfig(selection=ridge_cfg.selection)),
               "no_strength": ({**default, "strengths": ()}, ridge_cfg),
               "no_ffn": ({**default, "ffn": False}, ridge_cfg)}
    for ablation in config.ablations:
        if ablation.startswith("rank") and ablation[4:].isdigit() and int(ablation[4:]) > 0:
            options[ablation] = (default, RidgeConfig(
                selection="holdout", ranks=(int(ablation[4:]),), allow_full_rank=False))
        if ablation not in options:
            raise ValueError(f"unknown ablation {ablation!r}; expected one of {ABLATIONS}")
        kwargs, rc = options[ablation]
        v = make_variants(model, press, probed, [("patchkv",)], rc, kwargs)["patchkv"]
        records.append(_record("continuation", name, ratio, f"patchkv[{ablation}]", v,
                               score, **kept, patch_bytes_bf16=v["patch_bytes_bf16"]))


def aggregate(records):
    """One row per (compression, budget, method): ppl over all continuation tokens,
    retrieval accuracy over all questions, mean attention error and fit time."""
    groups = collections.OrderedDict()
    for r in records:
        groups.setdefault((r["compression"], round(r["budget"], 4), r["method"]),
                          []).append(r)
    rows = []
    for (name, budget, method), rs in groups.items():
        cont = [r for r in rs if r["kind"] == "continuation"]
        retr = [r for r in rs if r["kind"] == "retrieval"]
        row = {"compression": name, "budget": budget, "method": method}
        if cont:
            n = sum(r["n"] for r in cont)
            row["ppl"] = math.exp(sum(r["nll_sum"] for r in cont) / n)
            row["attn_err"] = float(np.mean([r["attn_err"] for r in cont]))
        if retr:
            row["retrieval_acc"] = sum(r["correct"] for r in retr) / sum(r["asked"] for r in retr)
        fits = [r["fit_s"] for r in rs if "fit_s" in r]
        if fits:
            row["fit_s"] = float(np.mean(fits))
        if any("patch_bytes" in r for r in rs):
            row["patch_MB"] = max(r.get("patch_bytes", 0) for r in rs) / 2 ** 20
            row["patch_MB_bf16"] = max(r.get("patch_bytes_bf16", 0) for r in rs) / 2 ** 20
        kv = [r["kv_bytes"] for r in rs if "kv_bytes" in r]
        if kv:
            row["kv_KB_kept"] = float(np.nanmean(kv)) / 1024
            # kept KV + patch (f32 cache, f32 patch), per context, mean over contexts
            row["total_MB"] = float(np.mean([r["kv_bytes"] + r.get("patch_bytes", 0)
                                             for r in rs if "kv_bytes" in r])) / 2 ** 20
        kv16 = [r["kv_bytes_bf16"] + r.get("patch_bytes_bf16", 0) for r in rs
                if "kv_bytes_bf16" in r]
        if kv16:
            row["total_MB_bf16"] = float(np.mean(kv16)) / 2 ** 20
        rows.append(row)
    return rows


def break_even(records) -> list[dict]:
    """Per continuation context, press, budget and patched method: the context length above
    which kept KV + patch takes fewer bytes than the full cache, and than each larger
    budget of the same press alone, with the cache and the patch both stored in f32 and
    both in bf16. Bytes per token from the real arrays at the run's context length (the
    kept KV of an eviction press grows linearly with the context; a rank-capped patch's
    bytes do not): a linear model of the measured bytes, not a measurement at each length.
    """
    cont = [r for r in records if r["kind"] == "continuation" and "kv_bytes" in r]
    out = []
    for i in sorted({r["context"] for r in cont}):
        rs = [r for r in cont if r["context"] == i]
        full = next(r for r in rs if r["method"] == "full")
        n = full["context_tokens"]
        alone = {(r["compression"], r["budget"]): r for r in rs if r["method"] == "none"}
        for r in rs:
            if (r["method"] in ("full", "none") or r["method"].endswith("@bf16")
                    or not r.get("patch_bytes")):
                continue
            for kv, suffix in (("f32", ""), ("bf16", "_bf16")):
                kept_pt = r["kv_bytes" + suffix] / n
                row = {"context": i, "context_tokens": n, "compression": r["compression"],
                       "budget": r["budget"], "method": r["method"], "storage": kv,
                       "patch_bytes": r["patch_bytes" + suffix],
                       "kept_bytes_per_token": kept_pt,
                       "vs_full": break_even_tokens(r["patch_bytes" + suffix], kept_pt,
                                                    full["kv_bytes" + suffix] / n)}
                for (name, budget), other in alone.items():
                    if name == r["compression"] and budget > r["budget"]:
                        row[f"vs_{name}@{budget:g}"] = break_even_tokens(
                            r["patch_bytes" + suffix], kept_pt, other["kv_bytes" + suffix] / n)
                out.append(row)
    return out


def gap_closed(rows, name, budget, method="patchkv"):
    get = {(r["compression"], r["budget"], r["method"]): r for r in rows}
    full = get[("full", 1.0, "full")].get("ppl", math.nan)
    none = get.get((name, budget, "none"), {}).get("ppl", math.nan)
    fixed = get.get((name, budget, method), {}).get("ppl", math.nan)
    # undefined (nan) where the press alone does not raise perplexity: there is no gap
    return (none - fixed) / (none - full) if none > full else math.nan


def _percent(fraction: float) -> str:
    return "undefined" if math.isnan(fraction) else f"{fraction:.0%}"


def gap_closed_per_context(records) -> dict:
    """{compression@budget: [gap closed on each continuation context]}: how much of the
    pooled number is one context's noise."""
    cont = [r for r in records if r["kind"] == "continuation"]
    out = {}
    for i in sorted({r["context"] for r in cont}):
        rows = aggregate([r for r in cont if r["context"] == i])
        for r in rows:
            if r["method"] == "none":
                key = f"{r['compression']}@{r['budget']:.3g}"
                out.setdefault(key, []).append(gap_closed(rows, r["compression"],
                                                          r["budget"]))
    return out


def flops_check(model, name, ratio, probed, ffn=False) -> dict:
    """XLA cost-analysis FLOPs of the compiled decode step, unpatched vs patched (the
    fitted W_o patch, and W_down patch with `ffn`, plus a W_q scale as the quantised
    caches' patches carry)."""
    press = press_transform(name, ratio)
    t = chain(press, patchkv(probes=probed.config or ProbeConfig(), ffn=ffn))
    press_state, state = t.calibrate(model, probed)
    c = model.config
    state = state._replace(query_scales=(np.full(c.n_heads, 1.2, np.float32),) * c.n_layers)
    m, states = prefilled(press.apply(model, press_state), probed)
    patched = t.apply(model, (press_state, state))
    lengths = probed.lengths[:1]
    return {"flops_unpatched": decode_flops(m, states, lengths),
            "flops_patched": decode_flops(patched, states, lengths),
            "same_param_shapes": param_shapes(m) == param_shapes(patched)}


def claims(rows, config, flops):
    out = []
    get = {(r["compression"], r["budget"], r["method"]): r for r in rows}
    quantized = sorted({(r["compression"], r["budget"]) for r in rows
                        if r["compression"].startswith("tasq")})
    targets = [(n, b) for n in TARGET_COMPRESSIONS if n in config.compressions
               for b in TARGET_BUDGETS if b in config.budgets] + quantized
    for name, budget in targets:
        if name not in TARGET_COMPRESSIONS or (name, budget, "patchkv") not in get:
            continue
        if "ppl" in get[(name, budget, "none")]:  # run with continuation contexts
            closed = gap_closed(rows, name, budget)
            no_gap = math.isnan(closed)
            measured = (f"undefined: {name}@{budget:.0%} alone "
                        f"{get[(name, budget, 'none')]['ppl']:.3f} <= full cache "
                        f"{get[('full', 1.0, 'full')]['ppl']:.3f}" if no_gap
                        else f"{closed:.1%}")
            out.append(common.claim(f"{name}@{budget:.0%}: PatchKV closes the continuation "
                                    "ppl gap", ">= 50%", measured,
                                    None if no_gap else bool(closed >= 0.5)))
        none = get[(name, budget, "none")].get("retrieval_acc")
        fixed = get[(name, budget, "patchkv")].get("retrieval_acc")
        if none is not None:
            out.append(common.claim(f"{name}@{budget:.0%}: PatchKV beats the unpatched "
                                    "press on retrieval", "acc > no-patch acc",
                                    f"{fixed:.2f} vs {none:.2f}", bool(fixed > none)))
    for name in config.compressions:
        small = get.get((name, SMALL_BUDGET, "patchkv"))
        large = get.get((name, LARGE_BUDGET, "none"))
        if small is None or large is None or "ppl" not in small:
            continue
        for suffix, what in (("", "f32"), ("_bf16", "bf16")):
            out.append(common.claim(
                f"{name}@{SMALL_BUDGET:.0%} + PatchKV: fewer total bytes (kept KV + patch, "
                f"{what}) than {name}@{LARGE_BUDGET:.0%} alone",
                "total < press alone", f"{small['total_MB' + suffix]:.2f} MB vs "
                f"{large['total_MB' + suffix]:.2f} MB",
                bool(small["total_MB" + suffix] < large["total_MB" + suffix])))
        for method, what in (("patchkv", "f32"), ("patchkv@bf16", "bf16")):
            fixed = get.get((name, SMALL_BUDGET, method), {})
            if "ppl" in fixed:
                out.append(common.claim(
                    f"{name}@{SMALL_BUDGET:.0%} + PatchKV ({what} patch): lower continuation "
                    f"ppl than {name}@{LARGE_BUDGET:.0%} alone", "ppl < press alone",
                    f"{fixed['ppl']:.3f} vs {large['ppl']:.3f}",
                    bool(fixed["ppl"] < large["ppl"])))
    if flops:
        out.append(common.claim("zero per-query overhead (decode-step FLOPs, param shapes)",
                                "equal", f"{flops['flops_patched']:.4g} vs "
                                f"{flops['flops_unpatched']:.4g}; shapes equal: "
                                f"{flops['same_param_shapes']}",
                                flops["flops_patched"] == flops["flops_unpatched"]
                                and flops["same_param_shapes"]))
    return out


def make_plot(rows, config):
    """One panel per metric the run measured, against the bytes each cache really holds
    (kept KV + patch, f32; issue 28: a patch is paid for in memory), or against the budget
    for rows without measured bytes."""
    def plot(fig):
        metrics = [(key, label) for key, label in (("ppl", "continuation perplexity"),
                                                   ("retrieval_acc", "retrieval accuracy"))
                   if any(key in r for r in rows)]
        bytes_axis = all("total_MB" in r for r in rows)

        def x_of(r):
            return r["total_MB"] if bytes_axis else r["budget"]

        full = next(r for r in rows if r["method"] == "full")
        for i, (key, label) in enumerate(metrics):
            ax = fig.add_subplot(1, len(metrics), i + 1)
            for name in config.compressions:
                for method, style in zip(map(method_name, config.methods),
                                         itertools.cycle(("-", "-", "--", ":", "-."))):
                    pts = sorted((x_of(r), r[key]) for r in rows if r["compression"] == name
                                 and r["method"] == method and key in r)
                    if pts:
                        ax.plot(*zip(*pts), style, marker="o", label=f"{name}/{method}")
            if key in full:
                ax.axhline(full[key], color="k", lw=0.8, label="full cache")
            for r in rows:
                if r["compression"].startswith("tasq") and key in r:
                    ax.plot(x_of(r), r[key], "*" if r["method"] == "patchkv" else "x",
                            ms=8, label=f"{r['compression']}/{r['method']}")
            ax.set_xlabel("kept KV + patch, MB (f32)" if bytes_axis
                          else "fraction of context KV bytes kept")
            ax.set_title(label, fontsize=9)
            ax.set_xscale("log")
        fig.axes[0].legend(fontsize=5)
    return plot


def _probe_mix(cfg: ProbeConfig) -> str:
    kinds = (("sampled continuations", cfg.n_generated), ("context repeats", cfg.n_repeat),
             ("sampled assistant replies", cfg.n_reply),
             ("calibration-text spans", cfg.n_text))
    return " + ".join(f"{n} {name}" for name, n in kinds if n) or "none"


def chat_probes(probe_cfg: ProbeConfig, config, tok) -> ProbeConfig:
    """Probes for chat contexts (retrieval: the context is an open user turn): the
    config's `retrieval.probes` overrides, with the tokenizer's reply prefix."""
    return dataclasses.replace(probe_cfg, **config.retrieval.get("probes", {}),
                               reply_prefix=reply_prefix(tok))


def ridge_config(config) -> RidgeConfig:
    """The ridge options of the config: `patch_rank` > 0 caps every patch at that rank
    (reduced-rank ridge, stored as two factors); `ridge_ranks` compete with full rank."""
    rank = int(config.get("patch_rank", 0))
    if rank < 0:
        raise ValueError(f"patch_rank must be >= 0 (0: no cap), got {rank}")
    if rank:
        return RidgeConfig(selection=config.ridge_selection, ranks=(rank,),
                           allow_full_rank=False)
    return RidgeConfig(selection=config.ridge_selection,
                       ranks=tuple(config.get("ridge_ranks", ())))


def evaluation_ids(tok, config) -> tuple[np.ndarray, tuple[int, int] | None, int, str]:
    """(token ids of the config's split, its [start, end) token range in the file or None,
    the whole text's length in tokens, the text's name). The pydoc prose: the protocol's
    dev / test halves of the held-out topics (`research.data.corpus_text`, disjoint by
    topic hash, checked on every read). A file at `text_path`: its first / second half
    of tokens (research.patchkv.tasks.split_range; contexts checked to stay inside).
    config.test_text "stdlib" (test runs only): the fresh test text (research.data)."""
    path = config.get("text_path", "")
    fresh = config.get("test_text", "pydoc")
    if path and fresh != "pydoc":
        raise ValueError(f"test_text={fresh!r} and text_path={path!r} both name the scored "
                         "text; give one")
    if not path:
        ids = np.asarray(tok.encode(data.split_text(config.split, fresh)), np.int32)
        name = ("fresh stdlib-docstring test text (research/data.py)" if fresh == "stdlib"
                else f"pydoc held-out prose, {config.split} half (topics)")
        return ids, None, len(ids), name
    ids = np.asarray(tok.encode(data.load_text(path)), np.int32)
    lo, hi = split_range(len(ids), config.split)
    return ids[lo:hi], (lo, hi), len(ids), path


def run(config, out_dir=None) -> common.Report:
    model, tok = load(config.gguf_path or None)
    split_ids, token_range, n_text, text_name = evaluation_ids(tok, config)
    lo = token_range[0] if token_range else 0
    probe_cfg = ProbeConfig(**config.probes.to_dict(), seed=config.seed)
    chat_probe_cfg = chat_probes(probe_cfg, config, tok)
    ridge_cfg = ridge_config(config)
    # n_contexts=0 (either kind) leaves that task out, e.g. a retrieval-only run
    cont = (continuation_tasks(split_ids, **config.continuation.to_dict())
            if config.continuation.n_contexts else [])
    windows = [(lo + w[0], lo + w[1]) for w in (t.window for t in cont)]
    if token_range:  # a file split by token halves: contexts stay in their half
        check_windows_in_split(windows, n_text, config.split)
    r = config.retrieval
    seed0 = config.seed + (0 if config.split == "test" else DEV_RETRIEVAL_SEEDS)
    retr = [retrieval_task(tok, split_ids, n_facts=r.n_facts, context_len=r.context_len,
                           seed=seed0 + i) for i in range(r.n_contexts)]
    quantizers = calibrate_quantizers(model, tok, config)
    text = probe_text(tok, config) if probe_cfg.n_text or chat_probe_cfg.n_text else None
    records = []
    total = (len(cont) + len(retr)) * (len(config.compressions) * len(config.budgets)
                                       + len(quantizers))
    with tqdm(total=total, desc="patchkv contexts x compressions x budgets") as bar:
        for i, task in enumerate(cont):
            run_context("continuation", model, tok, task, config, probe_cfg, ridge_cfg,
                        quantizers, records, bar, i, text)
        for i, task in enumerate(retr):
            run_context("retrieval", model, tok, task, config, chat_probe_cfg, ridge_cfg,
                        quantizers, records, bar, i, text)
    rows = aggregate(records)
    flops = None
    if config.check_flops:
        probed = probe_context(model, CalibrationData.from_context((cont or retr)[0].context),
                               probe_cfg,
                               text)
        flops = flops_check(model, config.compressions[0], min(config.budgets), probed,
                            patch_kwargs(config, "eviction")["ffn"])
    probe_s = [rec["probe_s"] for rec in records if "probe_s" in rec]
    columns = ["compression", "budget", "method", "ppl", "retrieval_acc", "attn_err",
               "fit_s", "patch_MB", "patch_MB_bf16", "kv_KB_kept", "total_MB",
               "total_MB_bf16"]
    closed = {f"{r['compression']}@{r['budget']:.3g}": gap_closed(rows, r["compression"],
                                                                 r["budget"])
              for r in rows if r["method"] == "none" and "ppl" in r
              and any(o["method"] == "patchkv" and o["compression"] == r["compression"]
                      and o["budget"] == r["budget"] for o in rows)}
    per_context = {k: v for k, v in gap_closed_per_context(records).items() if k in closed}
    even = break_even(records)
    full_kv = [rec["kv_bytes"] for rec in records if rec["method"] == "full"]
    notes = [
        f"split {config.split!r} of {text_name} ({n_text} tokens"
        + (f"; this split: tokens {list(token_range)}" if token_range else "")
        + f"): {len(cont)} continuation context(s) at token windows {windows} x "
        f"{config.continuation.n_continuations} continuations of "
        f"{config.continuation.continuation_len} tokens; {len(retr)} retrieval context(s) "
        f"x {r.n_facts} questions (seeds {seed0}+). ppl over continuation tokens 1..m-1.",
        "patchkv: W_o + Delta per layer"
        + (" then W_down + Delta_ffn" if patch_kwargs(config, "eviction")["ffn"] else "")
        + ", ridge fit sequentially on probe rows of "
        f"{probe_cfg.length} tokens ({_probe_mix(probe_cfg)}; retrieval contexts: "
        f"{_probe_mix(chat_probe_cfg)}), lambda by {config.ridge_selection}"
        + (f", rank capped at {max(ridge_cfg.ranks)} (stored as two factors)"
           if ridge_cfg.ranks and not ridge_cfg.allow_full_rank
           else f", rank from {ridge_cfg.ranks} or full" if ridge_cfg.ranks else "") + "; "
        "grkv/am: kept values (and AM biases) refit on the same probes (eviction only). "
        "'<method>@bf16': the same patch stored and applied in bfloat16.",
        "tasq-Nbit: TaSQ calibrated once on the calibration split "
        f"({config.tasq.n_seqs}x{config.tasq.seq_len} tokens), frozen, then "
        "chain(tasq, patchkv) per context; its budget is the context's KV bytes relative "
        "to the f32 cache (codebooks are per model, not counted).",
        f"probe building (shared per context, all methods): mean "
        f"{np.mean(probe_s):.1f}s; fit_s is per compression.",
        "bytes of real arrays: kv_KB_kept = the context's cache (f32) cut to its kept "
        "slots; patch_MB(_bf16) = the stored patch arrays (dense deltas, or a rank-capped "
        "patch's two factors) in f32 (bf16); total_MB = kept KV + patch, both f32; "
        "total_MB_bf16 = both bf16 (real cast arrays). Full f32 KV of each context: "
        + ", ".join(f"{b / 2 ** 20:.1f} MB" for b in full_kv) + ".",
    ] + ([
        "break-even context length (modeled: linear in n from the bytes measured at "
        "this length) above which kept KV + patch < the other cache: " + "; ".join(
            f"{e['compression']}@{e['budget']:g} {e['method']} ({e['storage']}): "
            + ", ".join(f"{k[3:]} {v:.0f}" for k, v in e.items() if k.startswith("vs_"))
            for e in even if e["context"] == 0),
    ] if even else []) + ([  # continuation contexts only (a retrieval-only run has none)
        "gap closed (ppl_none - ppl_patch) / (ppl_none - ppl_full; undefined where the "
        "press alone does not raise ppl): " + ", ".join(
            f"{k}: {_percent(v)}" for k, v in closed.items()),
        "gap closed on each continuation context: " + ", ".join(
            f"{k}: {' / '.join(map(_percent, v))}" for k, v in per_context.items()),
    ] if closed else [])
    return common.Report(
        columns=columns, rows=rows,
        title="PatchKV: ridge weight patches vs KV eviction on SmolLM2-135M-Instruct",
        claims=claims(rows, config, flops),
        extra={"records": records, "gap_closed": closed,
               "gap_closed_per_context": per_context, "flops": flops,
               "break_even": even, "split": config.split, "text": text_name,
               "text_tokens": n_text,
               "split_range": list(token_range) if token_range else None,
               "windows": windows},
        notes=notes, plot=make_plot(rows, config))
