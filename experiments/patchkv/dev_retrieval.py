"""Dev-split retrieval check of PatchKV probe mixes (the test run's retrieval contexts use
seeds config.seed + i; these use seeds from --seed-offset on, so no setting is chosen on a
test context).

    python -m experiments.patchkv.dev_retrieval --settings gen32,rep32 [--contexts 3]

Prints one JSON line per (setting, context, compression) with the questions answered
correctly, then a table of totals (the unpatched press and the full cache included).
"""
from __future__ import annotations

import argparse
import collections
import json
import time

from experiments.patchkv import experiment as ex
from experiments.patchkv.dev_sweep import SETTINGS, load_small, ridge_config
from research.patchkv import tasks
from research.patchkv.probes import ProbeConfig, probe_context, reference_model
from research.serving.generate import default_stop_tokens


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", default="gen32,rep32")
    ap.add_argument("--contexts", type=int, default=3)
    ap.add_argument("--seed-offset", type=int, default=1000)
    ap.add_argument("--budgets", default="0.1,0.25")
    args = ap.parse_args(argv)
    config, model, tok, heldout = load_small()
    r = config.retrieval
    stops = default_stop_tokens(tok)
    reply_prefix = tasks.reply_prefix(tok)
    text = ex.probe_text(tok, config)
    budgets = [float(b) for b in args.budgets.split(",")]
    totals = collections.Counter()
    asked = collections.Counter()
    for ci in range(args.contexts):
        task = tasks.retrieval_task(tok, heldout, n_facts=r.n_facts, context_len=r.context_len,
                                    seed=args.seed_offset + ci)
        length = len(task.context)

        def score(variant):
            return ex.score_retrieval(variant, length, task, tok, r.max_new_tokens,
                                      stops)["correct"]

        for name in args.settings.split(","):
            t0 = time.perf_counter()
            probe_over, selection, kwargs = SETTINGS[name]
            probe_cfg = ProbeConfig(**{**config.probes.to_dict(), "seed": config.seed,
                                       "reply_prefix": reply_prefix,
                                       **probe_over})
            probed = probe_context(model, ex._calibration(task.context), probe_cfg, text)
            first = name == args.settings.split(",")[0]
            if first:  # the full cache and the unpatched press do not depend on probes
                correct = score(ex.Variant(model=reference_model(model),
                                           states=probed.ref_states))
                totals[("full", "full")] += correct
                asked[("full", "full")] += r.n_facts
                print(json.dumps({"setting": "full", "ctx": ci, "correct": correct}), flush=True)
            for comp in config.compressions:
                for ratio in budgets:
                    key = f"{comp}@{ratio}"
                    m, states = ex.compressed_states(model, comp, ratio, probed)
                    methods = ["patchkv"] + (["none"] if first else [])
                    variants = ex.make_variants(m, states, probed, methods,
                                                ridge_config(selection),
                                                {"target": config.patch_target, **kwargs})
                    for meth, v in variants.items():
                        tag = name if meth == "patchkv" else "none"
                        correct = score(v)
                        totals[(tag, key)] += correct
                        asked[(tag, key)] += r.n_facts
                        print(json.dumps({"setting": tag, "ctx": ci, "comp": key,
                                          "correct": correct}), flush=True)
            print(f"# {name} ctx {ci}: {time.perf_counter() - t0:.0f}s", flush=True)
    keys = sorted({k for (_, k) in totals if k != "full"})
    print(f"full cache: {totals[('full', 'full')]}/{asked[('full', 'full')]}")
    print("| setting | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for name in ["none"] + args.settings.split(","):
        print(f"| {name} | " + " | ".join(f"{totals[(name, k)]}/{asked[(name, k)]}"
                                          for k in keys) + " |")


if __name__ == "__main__":
    main()
