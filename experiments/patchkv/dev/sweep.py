"""Dev-split sweep of PatchKV settings (probe mix, ridge selection, fit target).

Tunes on continuation contexts from the dev half of the held-out prose
(`research.data.corpus_text("dev")`, docs/protocol.md) at `--offset`; the test runs read
the test half (disjoint topics, checked on every read), so no setting is chosen on a test
context. (The defaults in patchkv.py older than that protocol were chosen by this script
on held-out windows at tokens 4096 and 8333 of the whole held-out text; see
experiments/patchkv/README.md.) Continuation perplexity only (retrieval is 8 questions:
too coarse to tune on).

    python -m experiments.patchkv.dev.sweep --settings base,t07,gen32 [--contexts 2]

Prints one JSON line per (setting, context, compression) and a gap-closed table
(pooled over the dev contexts: ppl = exp(total NLL / total tokens)).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

from experiments.patchkv import experiment as ex
from experiments.patchkv.patchkv import get_config
from research import data
from research.model import load
from research.patchkv import (DEV_QUERY_SCALES, DEV_STRENGTHS, ContextCache, ProbeConfig,
                              RidgeConfig, continuation_tasks, probe_context, reference_model,
                              score_continuations)
from research.transforms import CalibrationData

# name -> (probe overrides, ridge selection, fit_patches kwargs)
SETTINGS = {
    "base": ({}, "holdout", {}),
    "t07": ({"temperature": 0.7}, "holdout", {}),
    "gen32": ({"n_generated": 32, "n_repeat": 0}, "holdout", {}),
    "gen24rep8": ({"n_generated": 24, "n_repeat": 8}, "holdout", {}),
    "rep32": ({"n_generated": 0, "n_repeat": 32}, "holdout", {}),
    "gcv": ({}, "gcv", {}),
    "residual": ({}, "holdout", {"target": "residual"}),
    "x2": ({"n_generated": 32, "n_repeat": 32}, "holdout", {}),
    "x3": ({"n_generated": 48, "n_repeat": 48}, "holdout", {}),
    "gen64": ({"n_generated": 64, "n_repeat": 0}, "holdout", {}),
    "gen48rep16": ({"n_generated": 48, "n_repeat": 16}, "holdout", {}),
    "len128": ({"length": 128}, "holdout", {}),
    "x2_t07": ({"n_generated": 32, "n_repeat": 32, "temperature": 0.7}, "holdout", {}),
    "x2_residual": ({"n_generated": 32, "n_repeat": 32}, "holdout", {"target": "residual"}),
    "gen32_residual": ({"n_generated": 32, "n_repeat": 0}, "holdout", {"target": "residual"}),
    "gen32_gcv": ({"n_generated": 32, "n_repeat": 0}, "gcv", {}),
    "gen32_t07": ({"n_generated": 32, "n_repeat": 0, "temperature": 0.7}, "holdout", {}),
    "x2_gcv": ({"n_generated": 32, "n_repeat": 32}, "gcv", {}),
    "rep32_gcv": ({"n_generated": 0, "n_repeat": 32}, "gcv", {}),
    "x3_residual": ({"n_generated": 48, "n_repeat": 48}, "holdout", {"target": "residual"}),
    "gen32_rank": ({"n_generated": 32, "n_repeat": 0}, "holdout_rank", {}),
    "gen64_rank": ({"n_generated": 64, "n_repeat": 0}, "holdout_rank", {}),
    "gen64_residual": ({"n_generated": 64, "n_repeat": 0}, "holdout", {"target": "residual"}),
    "gen64_wide": ({"n_generated": 64, "n_repeat": 0}, "holdout",
                   {"strengths": DEV_STRENGTHS}),
    "gen64_residual_wide": ({"n_generated": 64, "n_repeat": 0}, "holdout",
                            {"target": "residual", "strengths": DEV_STRENGTHS}),
    "gen64_wide_qs": ({"n_generated": 64, "n_repeat": 0}, "holdout",
                      {"strengths": DEV_STRENGTHS, "query_scales": DEV_QUERY_SCALES}),
    "gen64_residual_wide_qs": ({"n_generated": 64, "n_repeat": 0}, "holdout",
                               {"target": "residual", "strengths": DEV_STRENGTHS,
                                "query_scales": DEV_QUERY_SCALES}),
    "gen128_wide": ({"n_generated": 128, "n_repeat": 0}, "holdout",
                    {"strengths": DEV_STRENGTHS}),
    # W_down patch (ffn) and text rows of the calibration split (probes.text_rows)
    "gen64_ffn": ({"n_generated": 64, "n_repeat": 0}, "holdout",
                  {"strengths": DEV_STRENGTHS, "ffn": True}),
    "text64_wide": ({"n_generated": 0, "n_repeat": 0, "n_text": 64}, "holdout",
                    {"strengths": DEV_STRENGTHS}),
    "text64_ffn": ({"n_generated": 0, "n_repeat": 0, "n_text": 64}, "holdout",
                   {"strengths": DEV_STRENGTHS, "ffn": True}),
    "text128_ffn": ({"n_generated": 0, "n_repeat": 0, "n_text": 128}, "holdout",
                    {"strengths": DEV_STRENGTHS, "ffn": True}),
    "text256_ffn": ({"n_generated": 0, "n_repeat": 0, "n_text": 256}, "holdout",
                    {"strengths": DEV_STRENGTHS, "ffn": True}),
    "gen64text64_ffn": ({"n_generated": 64, "n_repeat": 0, "n_text": 64}, "holdout",
                        {"strengths": DEV_STRENGTHS, "ffn": True}),
    "text128_ffn_qs": ({"n_generated": 0, "n_repeat": 0, "n_text": 128}, "holdout",
                       {"strengths": DEV_STRENGTHS, "ffn": True,
                        "query_scales": DEV_QUERY_SCALES}),
    "text128rep32_ffn": ({"n_generated": 0, "n_repeat": 32, "n_text": 128}, "holdout",
                         {"strengths": DEV_STRENGTHS, "ffn": True}),
    # context repeats alone with the W_down patch (retrieval contexts: dev.retrieval)
    **{f"rep{n}_ffn": ({"n_generated": 0, "n_repeat": n, "n_text": 0}, "holdout",
                       {"strengths": DEV_STRENGTHS, "ffn": True}) for n in (32, 64, 128)},
    "rep128l32_ffn": ({"n_generated": 0, "n_repeat": 128, "n_text": 0, "length": 32},
                      "holdout", {"strengths": DEV_STRENGTHS, "ffn": True}),
    # reply probes (chat contexts: retrieval; dev.retrieval fills in the reply prefix)
    "gen32reply32_wide": ({"n_generated": 32, "n_repeat": 0, "n_reply": 32}, "holdout",
                          {"strengths": DEV_STRENGTHS}),
    "reply64_wide": ({"n_generated": 0, "n_repeat": 0, "n_reply": 64}, "holdout",
                     {"strengths": DEV_STRENGTHS}),
    "am": ("baseline", "am", {}),
    "grkv": ("baseline", "grkv", {}),
}


RANKS = (8, 16, 32, 64, 128, 256)


def ridge_config(selection: str, baseline: bool = False) -> RidgeConfig:
    """A SETTINGS selection name as a RidgeConfig ("holdout_rank": reduced ranks compete)."""
    if baseline:
        return RidgeConfig(selection="holdout")
    if selection == "holdout_rank":
        return RidgeConfig(selection="holdout", ranks=RANKS)
    return RidgeConfig(selection=selection)


def load_small():
    """(small config, the embedded model, its tokenizer, token ids of the dev half of the
    held-out prose): what every dev script starts from."""
    model, tok = load(None)
    return get_config("small"), model, tok, tok.encode(data.corpus_text("dev"))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", default="base")
    ap.add_argument("--contexts", type=int, default=2)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--no-tasq", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated compressions to run "
                    "(e.g. tasq-1bit, snapkv); default: all of the config's")
    args = ap.parse_args(argv)
    config, model, tok, dev_ids = load_small()
    cc = config.continuation
    dev = continuation_tasks(dev_ids, n_contexts=args.contexts,
                                   context_len=cc.context_len,
                                   n_continuations=cc.n_continuations,
                                   continuation_len=cc.continuation_len, offset=args.offset)
    quantizers = {} if args.no_tasq else ex.calibrate_quantizers(model, tok, config)
    text = ex.probe_text(tok, config)
    combos = [(n, b) for n in config.compressions for b in config.budgets]
    combos += [(q, None) for q in quantizers]
    if args.only:
        only = args.only.split(",")
        unknown = sorted(set(only) - {n for n, _ in combos})
        if unknown:
            sys.exit(f"--only: unknown compressions {unknown}; expected some of "
                     f"{sorted({n for n, _ in combos})}")
        combos = [(n, b) for n, b in combos if n in only]
    nll = {}  # (setting, ctx, compression) -> (nll_sum, n, attn_err)
    ref = reference_model(model)
    full_contrib = {}
    names = args.settings.split(",")
    for ci, task in enumerate(dev):  # settings with the same probes share them
        probed_by_cfg = {}
        for name in names:
            probe_over, selection, kwargs = SETTINGS[name]
            baseline = probe_over == "baseline"
            probe_cfg = ProbeConfig(**{**config.probes.to_dict(), "seed": config.seed,
                                       **({} if baseline else probe_over)})
            ridge_cfg = ridge_config(selection, baseline)
            t0 = time.perf_counter()
            if probe_cfg not in probed_by_cfg:
                context = CalibrationData.from_context(task.context)
                probed_by_cfg = {probe_cfg: probe_context(model, context, probe_cfg, text)}
            probed = probed_by_cfg[probe_cfg]
            length = len(task.context)
            if ci not in full_contrib:
                ctx = ContextCache(probed.ref_states, length, None)
                full = score_continuations(ref, ctx, task.continuations, attention=True)
                full_contrib[ci] = full.attn_contrib
                nll[("full", ci, "full")] = (full.nll * full.n_tokens, full.n_tokens, 0.0)
            for comp, ratio in combos:
                if baseline and ratio is None:
                    continue
                key = f"{comp}@{ratio}" if ratio is not None else comp
                press = (ex.press_transform(comp, ratio) if ratio is not None
                         else quantizers[comp])
                methods = [(selection,) if baseline else ("patchkv",)]
                if ("none", ci, key) not in nll:
                    methods = [()] + methods
                variants = ex.make_variants(model, press, probed, methods, ridge_cfg, kwargs)
                for meth, v in variants.items():
                    s = ex.score_continuation(v, length, task, full_contrib[ci])
                    tag = "none" if meth == "none" else name
                    nll[(tag, ci, key)] = (s["nll_sum"], s["n"], s["attn_err"])
                    print(json.dumps({"setting": tag, "ctx": ci, "comp": key,
                                      "ppl": math.exp(s["nll_sum"] / s["n"]),
                                      "attn_err": s["attn_err"],
                                      **({k: v["summary"][k] for k in
                                          ("layers_patched", "ffn_layers_patched",
                                           "val_err_before", "val_err_after", "mean_rank",
                                           "patch_bytes", "strength", "strength_kl", "query_scale",
                                           "query_scale_kl")}
                                       if "summary" in v else {})}),
                          flush=True)
            print(f"# {name} ctx {ci}: {time.perf_counter() - t0:.0f}s", flush=True)
        print(table(nll, len(dev), names), flush=True)


def pooled(nll, tag, n_ctx, key):
    parts = [nll.get((tag, ci, key)) for ci in range(n_ctx)]
    if any(p is None for p in parts):
        return math.nan, math.nan
    return (math.exp(sum(p[0] for p in parts) / sum(p[1] for p in parts)),
            float(np.mean([p[2] for p in parts])))


def table(nll, n_ctx, names):
    keys = sorted({k for (_, _, k) in nll if k != "full"})
    full, _ = pooled(nll, "full", n_ctx, "full")
    lines = [f"| setting | {' | '.join(keys)} |", "|---" * (len(keys) + 1) + "|"]
    for name in ["none"] + names:
        cells = []
        for k in keys:
            ppl, err = pooled(nll, name, n_ctx, k)
            none, _ = pooled(nll, "none", n_ctx, k)
            gap = (none - ppl) / (none - full) if name != "none" else math.nan
            cells.append(f"{ppl:.2f} ({gap:.0%}, err {err:.3f})" if name != "none"
                         else f"{ppl:.2f} (err {err:.3f})")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    lines.append(f"full ppl {full:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
