"""SpecScale experiment (see specscale.py for the command and expected results)."""
from __future__ import annotations

import dataclasses

import jax

from experiments import common, protocol
from research.model import load
from research.transforms import CalibrationData
from research.specscale import (ArithmeticChains, PagedEngine, SearchConfig, SearchContext,
                                SearchResult, beam_search, best_of_n, merge_results,
                                paired_bootstrap_diff, run_search, single_sample, specscale,
                                step_auroc, wilson_interval)

# the dev/test protocol (experiments/protocol.py)
TECHNIQUE = "specscale"
DEFAULTS_CHOSEN_ON = ("python -m experiments.run "
                      "--config=experiments/specscale/specscale.py:dev")


def defaults(config) -> dict:
    return {"temperature": config.engine.temperature, "specscale": config.specscale.to_dict(),
            "beam": config.beam.to_dict(), "best_of_n": config.best_of_n,
            "process_verifier": config.process_verifier, "task": config.task.to_dict(),
            "limits": config.limits.to_dict()}


def problem_item(p):
    """An arithmetic problem as a ledger item: keyed by its content (start, operations),
    as its split is (research.specscale.tasks.problem_key)."""
    return protocol.content_item("arith problem", {"start": p.start, "ops": p.ops},
                                 p.text.strip())


def test_items(config) -> list:
    """The problems this run scores (the item ledger, experiments/protocol.py)."""
    return [problem_item(p) for p in split_problems(make_task(config), config)]


def scored_elsewhere(run_name: str) -> set[str]:
    """Ledger keys of the problems any run not named `run_name` has scored."""
    ledger = protocol.read_item_ledger(TECHNIQUE)
    return {k for s in ledger["scorings"] if s.get("run_name") != run_name
            for k in s["items"]}


def split_problems(task: ArithmeticChains, config) -> list:
    """The config's problems: the first n of its split in the seeded stream; with
    `unseen_only` (the fresh-problem rerun of issue 36), the first n of that stream that
    no other run has scored (the item ledger), so every one is new to the project."""
    n = config.n_problems
    if not config.get("unseen_only", False):
        return task.problems(n, seed=config.seed, split=config.split)
    seen = scored_elsewhere(config.run_name)
    pool = task.problems(n + len(seen), seed=config.seed, split=config.split)
    fresh = [p for p in pool if problem_item(p).key not in seen][:n]
    if len(fresh) < n:
        raise ValueError(f"only {len(fresh)} of {n} {config.split} problems are unscored")
    return [dataclasses.replace(p, uid=i) for i, p in enumerate(fresh)]


def prior_scorings() -> list[dict]:
    """Test scorings before the item ledger (issue 36), for `protocol.seed_history`."""
    return [{"label": "issue36:specscale-preprotocol-seed0", "count": 1, "reason": (
        "issue 36: the 24 pre-protocol seed-0 problems (the unsplit stream, 10 of them in "
        "the test split), scored at least once before the protocol"),
        "items": [problem_item(p) for p in ArithmeticChains().problems(24, seed=0)]}]


COLUMNS = ["method", "accuracy", "acc_95ci", "problems/s", "wall_s", "compile_s",
           "generated_tokens", "tokens_computed", "forward_calls", "verifier_judgements",
           "verifier_tokens", "verify_calls", "process_checks", "peak_kv_blocks",
           "peak_kv_MiB"]


def make_task(config) -> ArithmeticChains:
    t = config.task
    return ArithmeticChains(n_steps=t.n_steps, start_range=tuple(t.start_range),
                            operand_range=tuple(t.operand_range), n_shots=t.n_shots,
                            verifier_shots=t.verifier_shots)


def methods(config) -> list[SearchConfig]:
    """greedy, one sample, best-of-N, beam search with per-step verification, SpecScale
    (+ ablations). Every verifier-guided method uses the same verifiers: the likelihood
    verifier and, with config.process_verifier, the exact process check of each line."""
    lim = dict(config.limits)
    w, e = config.beam.beam_width, config.beam.expand
    pv = bool(config.process_verifier)
    spec = {"process": pv, "process_prune": pv, **dict(config.specscale)}
    out = [single_sample(greedy=True, **lim), single_sample(**lim),
           best_of_n(config.best_of_n, process=pv, **lim),
           beam_search(w, e, process=pv, **lim), specscale(w, e, **spec, **lim)]
    flips = {"+defer": dict(defer=2, reject_below=-1.5), "-defer": dict(defer=1),
             "+reject": dict(reject_below=-1.5), "-reject": dict(reject_below=None),
             "-prune": dict(prune_margin=None, prune_token_logp=None),
             "-dedup": dict(dedup=False), "-process_prune": dict(process_prune=False)}
    for name in config.ablations:
        if name not in flips:
            raise ValueError(f"unknown ablation {name!r}; expected one of {sorted(flips)}")
        out.append(specscale(w, e, **{**spec, **flips[name]}, **lim,
                               name=f"specscale {w}x{e} {name}"))
    return out


def result_row(res: SearchResult, block_bytes: int) -> dict:
    n = len(res.problems)
    k = sum(p.correct for p in res.problems)
    lo, hi = wilson_interval(k, n)
    st = res.stats
    return {"method": res.config.label, "accuracy": k / n, "acc_95ci": f"[{lo:.2f}, {hi:.2f}]",
            "problems/s": st["problems_per_s"], "wall_s": st["wall_s"],
            "compile_s": st["compile_s"], "generated_tokens": st["generated_tokens"],
            "tokens_computed": st["tokens_computed"], "forward_calls": st["forward_calls"],
            "verifier_judgements": st["verifier_judgements"],
            "verifier_tokens": st["verifier_tokens"], "verify_calls": st["verify_calls"],
            "process_checks": st["process_checks"],
            "peak_kv_blocks": st["peak_kv_blocks"],
            "peak_kv_MiB": st["peak_kv_blocks"] * block_bytes / 2**20}


def verifier_auroc(task, problems, judged) -> tuple[float, int]:
    by_uid = {p.uid: p for p in problems}
    labels = [task.step_is_correct(by_uid[uid], lines, len(lines) - 1)
              for uid, lines, _ in judged]
    return step_auroc([s for _, _, s in judged], labels), len(labels)


def run(config, out_dir=None) -> common.Report:
    model, tok = load(config.gguf_path or None)
    task = make_task(config)
    problems = split_problems(task, config)
    e = config.engine
    engine = PagedEngine(model, n_blocks=e.n_blocks, block_size=e.block_size,
                         max_len=e.max_len, temperature=e.temperature)
    ctx = SearchContext(engine, tok, task)
    results = run_interleaved(ctx, problems, methods(config), config)
    rows = [result_row(r, engine.block_bytes) for r in results.values()]
    ctx.close()
    del ctx, engine

    beam = results[beam_search(config.beam.beam_width, config.beam.expand).label]
    spec = results[specscale(config.beam.beam_width, config.beam.expand).label]
    memory = memory_runs(model, tok, task, problems[:config.memory_problems], config,
                         beam.config, spec.config)
    codec_rows = codec_memory_runs(model, tok, task, problems[:config.memory_problems],
                                   config, spec.config)
    auroc, n_steps = verifier_auroc(task, problems, beam.judged)
    claims, notes = make_claims(config, results, beam, spec, memory, auroc, n_steps)
    notes.append(codec_note(codec_rows))
    return common.Report(
        columns=COLUMNS, rows=rows,
        title="SpecScale on SmolLM2-135M-Instruct: arithmetic chains "
              f"({config.n_problems} problems, seed {config.seed})",
        claims=claims, notes=notes, plot=lambda fig: plot(fig, rows),
        extra={"memory": memory, "kv_codecs": codec_rows, "verifier_step_auroc": auroc,
               "verifier_steps_labelled": n_steps,
               "stats": {k: r.stats for k, r in results.items()},
               "answers": {k: [dict(uid=p.uid, answer=p.answer, predicted=p.predicted,
                                    correct=p.correct, text=p.text) for p in r.problems]
                           for k, r in results.items()},
               "jax_backend": jax.default_backend()})


def run_interleaved(ctx, problems, cfgs, config) -> dict[str, SearchResult]:
    """Methods take turns group by group, so machine-load drift hits all of them alike."""
    from tqdm.auto import tqdm
    g = config.group_size
    groups = [problems[i:i + g] for i in range(0, len(problems), g)]
    if config.get("warmup_pass", False):  # compile every batch shape; results discarded
        timed = tuple(config.get("warmup_methods", ()))  # () = every method
        warm = [c for c in cfgs if not timed or c.method in timed]
        for group in tqdm(groups, desc="warm-up pass"):
            for cfg in warm:
                run_search(ctx, group, cfg, seed=config.seed, group_size=g)
    parts: dict[str, list] = {c.label: [] for c in cfgs}
    with tqdm(total=len(groups) * len(cfgs), desc="groups x methods") as bar:
        for group in groups:
            for cfg in cfgs:
                parts[cfg.label].append(run_search(ctx, group, cfg, seed=config.seed,
                                                     group_size=g))
                bar.update()
    return {label: merge_results(p) for label, p in parts.items()}


def memory_runs(model, tok, task, group, config, beam_cfg, spec_cfg) -> list[dict]:
    """Peak KV blocks on one group: beam with / without prefix sharing, and SpecScale."""
    e = config.engine
    rows = []
    for cfg, share, n_blocks in ((beam_cfg, True, e.n_blocks), (spec_cfg, True, e.n_blocks),
                                 (beam_cfg, False, config.no_sharing_n_blocks)):
        engine = PagedEngine(model, n_blocks=n_blocks, block_size=e.block_size,
                             max_len=e.max_len, temperature=e.temperature, share_prefix=share)
        ctx = SearchContext(engine, tok, task)
        res = run_search(ctx, group, cfg, seed=config.seed, group_size=len(group),
                           progress=True)
        rows.append({"method": cfg.label + ("" if share else " (no sharing)"),
                     "problems": len(group), "peak_kv_blocks": res.stats["peak_kv_blocks"],
                     "peak_kv_MiB": res.stats["peak_kv_bytes"] / 2**20,
                     "block_copies": res.stats["block_copies"],
                     "texts": [p.text for p in res.problems]})
        ctx.close()
        del ctx, engine
    return rows


def codec_model(model, tok, name: str, config):
    """The model with the registered KV codec `name` (research/serving/kv_codecs.py; the
    committed runs' "float32" / "bfloat16" are f32 / bf16: common.LEGACY_KV_CODECS).
    Calibrated codecs calibrate on the corpus's calibration split with config.tasq's
    sizes and k-means knobs."""
    from research.serving import kv_codecs
    name = common.kv_codec_name(name)
    if not kv_codecs.get(name).calibrated:
        return kv_codecs.codec_model(model, name, seed=config.seed)
    t = config.tasq
    return kv_codecs.codec_model(
        model, name, calibration=CalibrationData.from_corpus(tok, t.seq_len, t.n_seqs),
        seed=config.seed, options=dict(kmeans_iters=t.kmeans_iters, max_points=t.max_points))


def codec_memory_runs(model, tok, task, group, config, spec_cfg) -> list[dict]:
    """SpecScale over the same paged pool with each KV codec's records in the pages."""
    e = config.engine
    rows = []
    for name in config.kv_codecs:
        engine = PagedEngine(codec_model(model, tok, name, config), n_blocks=e.n_blocks,
                             block_size=e.block_size, max_len=e.max_len,
                             temperature=e.temperature)
        ctx = SearchContext(engine, tok, task)
        res = run_search(ctx, group, spec_cfg, seed=config.seed, group_size=len(group),
                           progress=True)
        rows.append({"kv_codec": name, "cache": engine.model.caches[0].describe(),
                     "problems": len(group), "accuracy": res.accuracy,
                     "block_bytes": engine.block_bytes,
                     "peak_kv_blocks": res.stats["peak_kv_blocks"],
                     "peak_kv_MiB": res.stats["peak_kv_bytes"] / 2**20})
        ctx.close()
        del ctx, engine
    return rows


def codec_note(rows: list[dict]) -> str:
    """One line: SpecScale's peak KV bytes with each codec's records in the pages."""
    base = rows[0]["peak_kv_MiB"]
    parts = [f"{r['kv_codec']} ({r['cache']}): {r['peak_kv_MiB']:.2f} MiB peak "
             f"({r['peak_kv_blocks']} blocks x {r['block_bytes']} B, "
             f"{base / max(r['peak_kv_MiB'], 1e-12):.1f}x less than {rows[0]['kv_codec']}), "
             f"accuracy {r['accuracy']:.3f}" for r in rows]
    return (f"SpecScale on the first {rows[0]['problems']} problems with each KV codec in "
            "the pages of one pool: " + "; ".join(parts))


def make_claims(config, results, beam, spec, memory, auroc, n_steps):
    acc = {k: r.accuracy for k, r in results.items()}
    single = results[single_sample().label]
    best_search = max((k for k in acc if k not in ("greedy", "single sample")),
                      key=lambda k: acc[k])
    speedup = spec.stats["problems_per_s"] / beam.stats["problems_per_s"]
    diff, lo, hi = paired_bootstrap_diff([p.correct for p in spec.problems],
                                         [p.correct for p in beam.problems])
    n = len(single.problems)
    ci = {k: wilson_interval(round(a * n), n) for k, a in acc.items()}
    gain = acc[best_search] - acc["greedy"]
    apart = ci[best_search][0] > ci["greedy"][1]
    reaches = acc[spec.config.label] >= acc[best_search] - 0.01
    beam_mem, spec_mem, none_mem = (m["peak_kv_blocks"] for m in memory)
    share_ratio = none_mem / max(spec_mem, 1)
    claims = [
        common.claim("one sample is mostly wrong", "single-sample acc < 0.5",
                     f"{acc['single sample']:.3f} (greedy {acc['greedy']:.3f})",
                     acc["single sample"] < 0.5),
        common.claim("the best search beats greedy decoding",
                     ">= +10 points, 95% Wilson intervals apart",
                     f"{best_search}: {acc[best_search]:.3f} {_ci(ci[best_search])} vs greedy "
                     f"{acc['greedy']:.3f} {_ci(ci['greedy'])} ({100 * gain:+.1f} points)",
                     gain >= 0.10 and apart),
        common.claim("SpecScale reaches the best search's accuracy", "acc >= best - 0.01",
                     f"{acc[spec.config.label]:.3f} vs {best_search} {acc[best_search]:.3f}",
                     reaches),
        common.claim("SpecScale throughput vs beam search (per-step verification)",
                     ">= 2x problems/s", f"{speedup:.2f}x", speedup >= 2.0),
        common.claim("SpecScale vs beam search accuracy (paired, same problems)",
                     "report", f"{acc[spec.config.label]:.3f} vs {acc[beam.config.label]:.3f} "
                     f"(paired diff {diff:+.3f}, 95% CI [{lo:+.3f}, {hi:+.3f}])", None),
        common.claim("peak KV blocks well below the no-sharing baseline",
                     "<= 0.5x no-sharing",
                     f"{memory[0]['problems']} problems: specscale {spec_mem}, beam "
                     f"{beam_mem}, beam without sharing {none_mem} blocks "
                     f"(specscale {1 / share_ratio:.2f}x)", share_ratio >= 2.0),
    ]
    same_text = sum(a.text == b.text for a, b in zip(spec.problems, beam.problems))
    half = max(wilson_interval(round(a * n), n)[1] - a for a in acc.values())
    notes = [
        f"single sample = one path at the search temperature ({config.engine.temperature}); "
        f"greedy decoding scores {acc['greedy']:.3f}, best search {acc[best_search]:.3f}",
        f"accuracy uncertainty: {n} problems, 95% Wilson half-widths up to {half:.2f}; a "
        "1-point accuracy difference is below what this run can resolve",
        f"verifier: step-level AUROC {auroc:.3f} over {n_steps} judged steps of beam search "
        "(ground truth from the task checker)",
        "problems/s excludes JAX compile time (measured with jax.monitoring and subtracted); "
        "wall_s includes it; methods run interleaved group by group in one process, so "
        "load from other jobs on the machine affects all of them alike",
        f"SpecScale's final text equals beam search's on {same_text}/{n} problems "
        "(dedup keeps beam search's decisions; pruning, process-check pruning, rejection and "
        "deferral may change them)",
        f"problems: the {config.split} split (seed {config.seed}), {n} problems whose "
        "content hashes into that split (research/core/splits.py: disjoint from the other "
        "split by construction)",
        f"beam without prefix sharing gives the same texts as with sharing: "
        f"{memory[2]['texts'] == memory[0]['texts']} (block copies: "
        f"{memory[2]['block_copies']} vs {memory[0]['block_copies']})",
    ]
    return claims, notes


def _ci(interval) -> str:
    return f"[{interval[0]:.2f}, {interval[1]:.2f}]"


def plot(fig, rows) -> None:
    ax = fig.add_subplot(1, 1, 1)
    for r in rows:
        lo, hi = (float(x) for x in r["acc_95ci"].strip("[]").split(","))
        x = r["tokens_computed"]
        ax.errorbar([x], [r["accuracy"]], yerr=[[r["accuracy"] - lo], [hi - r["accuracy"]]],
                    fmt="o", capsize=3, label=f"{r['method']} ({r['problems/s']:.3f} prob/s)")
    ax.set_xscale("log")
    ax.set_xlabel("tokens computed by the model (generation + verification), all problems")
    ax.set_ylabel("accuracy (95% Wilson CI)")
    ax.set_title("accuracy vs compute")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
