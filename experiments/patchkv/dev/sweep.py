"""Dev-split sweep of PatchKV settings (probe mix, ridge selection, fit target).

Tunes on continuation contexts from the dev half of the held-out prose
(`research.data.corpus_text("dev")`, docs/protocol.md) at `--offset`; the test runs read
the test half (disjoint topics, checked on every read), so no setting is chosen on a test
context. (The defaults in patchkv.py older than that protocol were chosen by this script
on held-out windows at tokens 4096 and 8333 of the whole held-out text; see
experiments/patchkv/README.md.) Continuation perplexity only (retrieval is 8 questions:
too coarse to tune on).

    python -m experiments.run --config=experiments/patchkv/dev/sweep.py \
        --config.settings=base,t07,gen32 [--config.contexts=2] [--config.offset=0] \
        [--config.tasq=False] [--config.only=snapkv@0.1,tasq-1bit]

A dev run of `experiments.run` (config.split = "dev": recorded as such in
results.json["protocol"], never counted in the test ledgers), written to
`<workdir>/patchkv_dev_sweep/`: one row per (setting, context, compression) (also printed
as a JSON line as it goes) and a gap-closed table (pooled over the dev contexts:
ppl = exp(total NLL / total tokens)).
"""
from __future__ import annotations

import json
import math
import time

import ml_collections
import numpy as np

from experiments import common
from experiments.patchkv import experiment as ex
from experiments.patchkv.patchkv import get_config as patchkv_config
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


def load_small(gguf_path: str | None = None):
    """(small config, the model (the embedded SmolLM2 by default), its tokenizer, token ids
    of the dev half of the held-out prose): what every dev script starts from."""
    model, tok = load(gguf_path or None)
    config = patchkv_config("small")
    if gguf_path:
        config.gguf_path = gguf_path
    return config, model, tok, tok.encode(data.corpus_text("dev"))


# the dev/test protocol (experiments/protocol.py): a dev sweep, where defaults are chosen
TECHNIQUE = "patchkv"
DEFAULTS_CHOSEN_ON = ("this dev sweep chooses them: python -m experiments.run "
                      "--config=experiments/patchkv/dev/sweep.py")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The sweep's config; the PatchKV config it starts from is patchkv.py's "small"."""
    if arg:
        raise ValueError(f"the sweep's config takes no argument (got {arg!r}); override "
                         "its fields with --config.<field>=...")
    c = ml_collections.ConfigDict()
    c.experiment = "experiments.patchkv.dev.sweep"
    c.run_name = "patchkv_dev_sweep"
    c.split = "dev"  # a dev sweep only: `test_items` refuses the test split
    c.seed = 0
    c.gguf_path = ""  # empty: the embedded SmolLM2-135M-Instruct
    c.settings = "base"  # comma-separated names of SETTINGS
    c.contexts = 2
    c.offset = 0
    c.tasq = True  # False: no TaSQ quantizers (no calibration)
    c.only = ""  # comma-separated compressions to run (e.g. tasq-1bit, snapkv); "" = all
    return c


def defaults(config) -> dict:
    """The PatchKV defaults the sweep starts from and the settings it tries (a dev run:
    recorded in results.json, counted nowhere)."""
    names = [n for n in config.settings.split(",") if n]
    unknown = sorted(set(names) - set(SETTINGS))
    if unknown or not names:
        raise ValueError(f"config.settings: unknown {unknown}; expected some of "
                         f"{sorted(SETTINGS)}")
    return {"patchkv": ex.defaults(patchkv_config("small")), "settings": names}


def test_items(config):
    raise ValueError(f"{config.experiment} is a dev sweep: config.split must be 'dev'")


COLUMNS = ["setting", "ctx", "comp", "ppl", "attn_err"]


def run(sweep, out_dir) -> common.Report:
    del out_dir  # nothing beyond the result files
    if sweep.split != "dev":
        test_items(sweep)
    names = defaults(sweep)["settings"]
    config, model, tok, dev_ids = load_small(sweep.gguf_path or None)
    cc = config.continuation
    dev = continuation_tasks(dev_ids, n_contexts=sweep.contexts,
                                   context_len=cc.context_len,
                                   n_continuations=cc.n_continuations,
                                   continuation_len=cc.continuation_len, offset=sweep.offset)
    quantizers = ex.calibrate_quantizers(model, tok, config) if sweep.tasq else {}
    text = ex.probe_text(tok, config)
    combos = [(n, b) for n in config.compressions for b in config.budgets]
    combos += [(q, None) for q in quantizers]
    if sweep.only:
        only = sweep.only.split(",")
        unknown = sorted(set(only) - {n for n, _ in combos})
        if unknown:
            raise ValueError(f"config.only: unknown compressions {unknown}; expected some "
                             f"of {sorted({n for n, _ in combos})}")
        combos = [(n, b) for n, b in combos if n in only]
    nll = {}  # (setting, ctx, compression) -> (nll_sum, n, attn_err)
    rows = []
    ref = reference_model(model)
    full_contrib = {}
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
                    row = {"setting": tag, "ctx": ci, "comp": key,
                           "ppl": math.exp(s["nll_sum"] / s["n"]),
                           "attn_err": s["attn_err"],
                           **({k: v["summary"][k] for k in
                               ("layers_patched", "ffn_layers_patched",
                                "val_err_before", "val_err_after", "mean_rank",
                                "patch_bytes", "strength", "strength_kl", "query_scale",
                                "query_scale_kl")}
                              if "summary" in v else {})}
                    rows.append(row)
                    print(json.dumps(row, default=str), flush=True)
            print(f"# {name} ctx {ci}: {time.perf_counter() - t0:.0f}s", flush=True)
        print(table(nll, len(dev), names), flush=True)
    columns, gap_rows, full = table_rows(nll, len(dev), names)
    return common.Report(
        columns=COLUMNS + sorted({k for r in rows for k in r} - set(COLUMNS)), rows=rows,
        title=f"PatchKV dev sweep ({len(dev)} dev context(s) at offset {sweep.offset})",
        tables=[{"title": f"pooled ppl (gap closed, attention error); full cache ppl "
                          f"{full:.2f}", "columns": columns, "rows": gap_rows}],
        notes=["dev half of the held-out prose only (docs/protocol.md)"])


def pooled(nll, tag, n_ctx, key):
    parts = [nll.get((tag, ci, key)) for ci in range(n_ctx)]
    if any(p is None for p in parts):
        return math.nan, math.nan
    return (math.exp(sum(p[0] for p in parts) / sum(p[1] for p in parts)),
            float(np.mean([p[2] for p in parts])))


def table_rows(nll, n_ctx, names):
    """(columns, rows, full-cache ppl) of the gap-closed table: per setting and
    compression "ppl (gap closed, err attention error)", pooled over the contexts."""
    keys = sorted({k for (_, _, k) in nll if k != "full"})
    full, _ = pooled(nll, "full", n_ctx, "full")
    rows = []
    for name in ["none"] + names:
        row = {"setting": name}
        for k in keys:
            ppl, err = pooled(nll, name, n_ctx, k)
            none, _ = pooled(nll, "none", n_ctx, k)
            gap = (none - ppl) / (none - full) if name != "none" else math.nan
            row[k] = (f"{ppl:.2f} ({gap:.0%}, err {err:.3f})" if name != "none"
                      else f"{ppl:.2f} (err {err:.3f})")
        rows.append(row)
    return ["setting", *keys], rows, full


def table(nll, n_ctx, names):
    columns, rows, full = table_rows(nll, n_ctx, names)
    return common.markdown_table(columns, rows) + f"\nfull ppl {full:.2f}"


if __name__ == "__main__":
    raise SystemExit("run it through the experiment runner:\n  python -m experiments.run "
                     "--config=experiments/patchkv/dev/sweep.py --config.settings=base")
