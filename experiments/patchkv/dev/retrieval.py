"""Dev-split retrieval check of PatchKV probe mixes (the test run's retrieval contexts use
seeds config.seed + i; these use seeds from --seed-offset on, so no setting is chosen on a
test context).

    python -m experiments.run --config=experiments/patchkv/dev/retrieval.py \
        --config.settings=rep32_ffn,rep64_ffn [--config.contexts=3] \
        [--config.compressions=snapkv@0.1,streaming_llm@0.25,tasq-1bit]

A dev run of `experiments.run` (config.split = "dev": recorded as such in
results.json["protocol"], never counted in the test ledgers), written to
`<workdir>/patchkv_dev_retrieval/`: one row per (setting, context, compression) (also
printed as a JSON line as it goes): the questions answered correctly (greedy, exact match)
and each answer's teacher-forced log-probability (the sum over its tokens: finer than 4
right-or-wrong answers), then a table of totals (the unpatched press and the full cache
included).
"""
from __future__ import annotations

import collections
import json
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import common
from experiments.patchkv import experiment as ex
from experiments.patchkv.dev import sweep
from experiments.patchkv.dev.sweep import SETTINGS, load_small, ridge_config
from research.patchkv import (ProbeConfig, pad_rows, probe_context, query_forward,
                              reference_model, reply_prefix, retrieval_task, tile_states)
from research.transforms import CalibrationData
from research.decode.generate import default_stop_tokens

DEFAULT_COMPRESSIONS = ("snapkv@0.1,snapkv@0.25,streaming_llm@0.1,streaming_llm@0.25,"
                        "tasq-1bit")


def answer_rows(tok, task) -> list[tuple[np.ndarray, int]]:
    """(question + " " + answer token ids, question length) per question."""
    rows = []
    for q, a in zip(task.questions, task.answers):
        full = np.asarray(tok.encode(tok.decode(list(q)) + " " + a), np.int32)
        if list(full[:len(q)]) != list(q):
            raise ValueError(f"the answer {a!r} changes the question's tokenization")
        rows.append((full, len(q)))
    return rows


def answer_log_probs(variant, length, rows) -> list[float]:
    """Teacher-forced log p(answer tokens | context, question) per question."""
    tokens, lengths = pad_rows([r for r, _ in rows])
    states = tile_states(variant["states"], np.zeros(len(rows), np.int32))
    logits, _ = query_forward(variant["model"], jnp.asarray(tokens),
                                      jnp.full((len(rows),), length, jnp.int32),
                                      jnp.asarray(lengths), states)
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
    return [float(sum(logp[i, t - 1, r[t]] for t in range(n, len(r))))
            for i, (r, n) in enumerate(rows)]


def press(comp, quantizers):
    """The press of one "<policy>@<ratio>" or quantizer-name compression."""
    if "@" in comp:
        name, ratio = comp.split("@")
        return ex.press_transform(name, float(ratio))
    if comp not in quantizers:
        raise ValueError(f"--compressions: {comp!r} is neither <policy>@<ratio> nor one of "
                         f"the config's quantizers {sorted(quantizers)}")
    return quantizers[comp]


# the dev/test protocol (experiments/protocol.py): a dev sweep, where defaults are chosen
TECHNIQUE = "patchkv"
DEFAULTS_CHOSEN_ON = ("this dev sweep chooses them: python -m experiments.run "
                      "--config=experiments/patchkv/dev/retrieval.py")
COLUMNS = ["setting", "ctx", "comp", "correct", "answer_log_probs"]


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    if arg:
        raise ValueError(f"the sweep's config takes no argument (got {arg!r}); override "
                         "its fields with --config.<field>=...")
    c = ml_collections.ConfigDict()
    c.experiment = "experiments.patchkv.dev.retrieval"
    c.run_name = "patchkv_dev_retrieval"
    c.split = "dev"  # a dev sweep only: `test_items` refuses the test split
    c.seed = 0
    c.gguf_path = ""  # empty: the embedded SmolLM2-135M-Instruct
    c.settings = "rep32_ffn,rep64_ffn"
    c.contexts = 3
    c.seed_offset = 1000  # retrieval seeds of the dev contexts (the test runs use 0+)
    c.compressions = DEFAULT_COMPRESSIONS
    return c


def defaults(config) -> dict:
    """The PatchKV defaults the sweep starts from, the settings it tries and the dev seeds
    (a dev run: recorded in results.json, counted nowhere)."""
    return {**sweep.defaults(config), "seed_offset": config.seed_offset}


def test_items(config):
    raise ValueError(f"{config.experiment} is a dev sweep: config.split must be 'dev'")


def run(sweep_config, out_dir) -> common.Report:
    del out_dir  # nothing beyond the result files
    if sweep_config.split != "dev":
        test_items(sweep_config)
    if sweep_config.seed_offset < 1000:
        raise ValueError("config.seed_offset < 1000 would draw the test runs' retrieval "
                         "contexts (seeds 0+)")
    settings = sweep.defaults(sweep_config)["settings"]
    config, model, tok, dev_ids = load_small(sweep_config.gguf_path or None)
    r = config.retrieval
    stops = default_stop_tokens(tok)
    prefix = reply_prefix(tok)
    text = ex.probe_text(tok, config)
    comps = sweep_config.compressions.split(",")
    quantizers = (ex.calibrate_quantizers(model, tok, config)
                  if any("@" not in c for c in comps) else {})
    totals, asked = collections.Counter(), collections.Counter()
    log_probs = collections.defaultdict(list)
    report_rows = []
    for ci in range(sweep_config.contexts):
        task = retrieval_task(tok, dev_ids, n_facts=r.n_facts, context_len=r.context_len,
                                    seed=sweep_config.seed_offset + ci)
        length, rows = len(task.context), answer_rows(tok, task)

        def score(tag, key, variant):
            correct = ex.score_retrieval(variant, length, task, tok, r.max_new_tokens,
                                         stops)["correct"]
            lp = answer_log_probs(variant, length, rows)
            totals[(tag, key)] += correct
            asked[(tag, key)] += r.n_facts
            log_probs[(tag, key)] += lp
            row = {"setting": tag, "ctx": ci, "comp": key, "correct": correct,
                   "answer_log_probs": [round(x, 2) for x in lp]}
            report_rows.append(row)
            print(json.dumps(row), flush=True)

        for name in settings:
            t0 = time.perf_counter()
            probe_over, selection, kwargs = SETTINGS[name]
            probe_cfg = ProbeConfig(**{**config.probes.to_dict(), "seed": config.seed,
                                       "reply_prefix": prefix, **probe_over})
            probed = probe_context(model, CalibrationData.from_context(task.context),
                                   probe_cfg, text)
            first = name == settings[0]
            if first:  # the full cache and the unpatched press do not depend on probes
                score("full", "full", ex.Variant(model=reference_model(model),
                                                 states=probed.ref_states))
            for comp in comps:
                methods = [("patchkv",)] + ([()] if first else [])
                variants = ex.make_variants(model, press(comp, quantizers), probed, methods,
                                            ridge_config(selection),
                                            {"target": config.patch_target, **kwargs})
                for meth, v in variants.items():
                    score(name if meth == "patchkv" else "none", comp, v)
            print(f"# {name} ctx {ci}: {time.perf_counter() - t0:.0f}s", flush=True)
    full = (f"full cache: {totals[('full', 'full')]}/{asked[('full', 'full')]}, mean "
            f"answer log-prob {np.mean(log_probs[('full', 'full')]):.2f}")
    total_rows = [{"setting": name, **{
        k: f"{totals[(name, k)]}/{asked[(name, k)]} ({np.mean(log_probs[(name, k)]):.2f})"
        for k in comps}} for name in ["none"] + settings]
    return common.Report(
        columns=COLUMNS, rows=report_rows,
        title=f"PatchKV dev retrieval ({sweep_config.contexts} dev context(s), seeds "
              f"{sweep_config.seed_offset}+)",
        tables=[{"title": "correct / asked (mean answer log-prob)",
                 "columns": ["setting", *comps], "rows": total_rows}],
        notes=[full, "dev half of the held-out prose only (docs/protocol.md)"])


if __name__ == "__main__":
    raise SystemExit("run it through the experiment runner:\n  python -m experiments.run "
                     "--config=experiments/patchkv/dev/retrieval.py")
