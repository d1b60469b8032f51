"""Speculative decoding vs plain decoding (see specdecode.py for the command).

Every timing compares variants on the same prompt in one process, interleaved
(plain, A, B, plain, A, B, ...) after a warm-up run that also compiles, and reports
medians: load drift on the shared CPU hits every variant alike.
"""
from __future__ import annotations

import statistics

import jax
import numpy as np
from tqdm import tqdm

from experiments import common, protocol
from experiments.specdecode import prompts as P
from research.core.timing import geomean, time_interleaved
from research.model import load
from research.decode.generate import PAD_BUCKET, default_stop_tokens, generate, round_up
from research.decode.sampling import SamplingConfig
from research.specdecode import (DraftLengthPolicy, chisquare_pvalue, early_exit,
                                 exact_sequence_law, measure_step_costs, model_drafter,
                                 prompt_lookup, speculative_generate)


# the dev/test protocol (experiments/protocol.py)
TECHNIQUE = "specdecode"
DEFAULTS_CHOSEN_ON = "python -m experiments.run --config=experiments/specdecode/specdecode.py:dev"


def prompt_item(text: str, chat: bool):
    """A prompt as a ledger item, keyed by its text and whether the chat template wraps it."""
    return protocol.content_item("prompt", {"text": text, "chat": bool(chat)},
                                 text[:60].replace("\n", " "))


def scored_prompts(config) -> tuple:
    """(repetitive, free-form) prompts of the config's split and test prompt set."""
    return P.split_prompts(config.split, config.get("test_prompts", "original"))


def test_items(config) -> list:
    """Every prompt of the config's split (prompts.py): what the run scores."""
    return [prompt_item(t, chat) for group in scored_prompts(config) for t, chat in group]


def prior_scorings() -> list[dict]:
    """Test scorings before the item ledger (issue 36), for `protocol.seed_history`."""
    old_tuning = [  # the first two repetitive and free-form prompts of 68fabd0's prompts.py
        (f"Rewrite the following paragraph, replacing 'cat' with 'dog':\n\n{P.PARAGRAPH}",
         True),
        (P.DOC + "\n" + P.DOC + "\n" + P.DOC[:80], False),
        ("What are three benefits of regular exercise?", True),
        ("Write a short story about a robot who learns to paint.", True)]
    return [{"label": "issue36:specdecode-old-tuning-prompts", "count": 1, "reason": (
        "issue 36: the four prompts the pre-protocol policy was tuned on (68fabd0's small "
        "config: the first two repetitive and free-form prompts) are test prompts now; "
        "scored at least once before the protocol"),
        "items": [prompt_item(t, chat) for t, chat in old_tuning]}]


def defaults(config) -> dict:
    return {"policy": config.policy.to_dict(), "draft_lengths": list(config.draft_lengths),
            "max_ngram": config.max_ngram}


def _ids(tok, prompt):
    text, chat = prompt
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}])
    return tok.encode(text)


def _time_interleaved(fns: dict, repeats: int) -> dict:
    """Per-variant wall and process-CPU timings, rounds alternating the order (A B C,
    C B A, ...); the callers warm up (and keep the results) first. Compare variants with
    `_paired_speedup` (ratios within a round cancel slow load drift)."""
    return time_interleaved(fns, warmup=0, repeats=repeats, alternate=True)


def _paired_speedup(times, name, kind="wall_s"):
    """Median over rounds of plain / variant time in the same round (kind: wall_s, cpu_s)."""
    return statistics.median(p / v for p, v in zip(times["plain"][kind], times[name][kind]))


def _spec_fn(model, ids, drafter, policy, max_new, stops):
    return lambda: speculative_generate(model, ids, drafter=drafter, max_new_tokens=max_new,
                                        stop_tokens=stops, policy=policy)


def _cost_curves(model, config, max_len):
    """Step cost vs k for both drafters (each branch compiled and timed round-robin)."""
    lookup = measure_step_costs(model, prompt_lookup(config.max_ngram), config.draft_lengths,
                                max_len=max_len, repeats=config.cost_repeats)
    exit_ = measure_step_costs(model, early_exit(config.early_exit_layers),
                               config.early_exit_draft_lengths, max_len=max_len,
                               repeats=config.cost_repeats)
    return {"prompt_lookup": lookup, "early_exit": exit_}


def _variants(config, costs):
    ks = tuple(config.draft_lengths)
    lookup = prompt_lookup(config.max_ngram)
    fit = tuple(costs["prompt_lookup"]["linear_fit"])
    if config.split == "dev":  # the policy grid
        return {_grid_name(g): (lookup, DraftLengthPolicy(draft_lengths=ks, costs=fit, **g))
                for g in config.policy_grid}
    return {
        "lookup_adaptive": (lookup, DraftLengthPolicy(draft_lengths=ks, costs=fit,
                                                      **config.policy)),
        f"lookup_fixed_k{config.fixed_draft}": (lookup, DraftLengthPolicy(
            draft_lengths=(0, config.fixed_draft), adaptive=False)),
    }


def _grid_name(g) -> str:
    return ("lookup_adaptive[" + ",".join(f"{k}={g[k]}" for k in sorted(g)) + "]")


def _prompt_rows(model, tok, config, variants, exit_variant, stops):
    """One row per (category, prompt, variant) with acceptance, tokens/forward, speedup:
    every prompt of the config's split (prompts.py)."""
    rows = []
    repetitive, free_form = scored_prompts(config)
    cats = [("repetitive", repetitive), ("free_form", free_form)]
    jobs = [(cat, i, text) for cat, texts in cats for i, text in enumerate(texts)]
    for cat, i, text in tqdm(jobs, desc="prompts"):
        ids = [_ids(tok, text)]
        fns = {"plain": lambda ids=ids: generate(model, ids, max_new_tokens=config.max_new_tokens,
                                                 stop_tokens=stops)}
        chosen = dict(variants)
        if i < config.early_exit_prompts:
            chosen.update(exit_variant)
        for name, (drafter, policy) in chosen.items():
            fns[name] = _spec_fn(model, ids, drafter, policy, config.max_new_tokens, stops)
        outs = {name: fn() for name, fn in fns.items()}  # warm-up (compiles), results
        times = _time_interleaved(fns, config.repeats)
        n_tokens = len(outs["plain"].tokens[0])
        for name, out in outs.items():
            row = {"category": cat, "prompt": i, "variant": name, "prompt_tokens": len(ids[0]),
                   "new_tokens": n_tokens,
                   "wall_s": statistics.median(times[name]["wall_s"]),
                   "speedup": _paired_speedup(times, name),
                   "cpu_speedup": _paired_speedup(times, name, "cpu_s")}
            if name != "plain":
                st = out.stats
                row.update(greedy_identical=out.tokens == outs["plain"].tokens,
                           acceptance=st.acceptance_rate,
                           tokens_per_forward=out.tokens_per_forward(),
                           drafted=sum(st.drafted), forwards=st.steps,
                           branches=" ".join(f"k{k}:{n}" for k, n in st.branch_counts.items()
                                             if n))
            rows.append(row)
    return rows


def _summary(rows):
    """Per (category, variant): geometric mean over prompts of the per-prompt speedups."""
    out = []
    keys = sorted({(r["category"], r["variant"]) for r in rows if r["variant"] != "plain"})
    for cat, var in keys:
        mine = [r for r in rows if r["category"] == cat and r["variant"] == var]
        drafted = sum(m["drafted"] for m in mine)
        out.append({
            "category": cat, "variant": var, "prompts": len(mine),
            "speedup": geomean([m["speedup"] for m in mine]),
            "cpu_speedup": geomean([m["cpu_speedup"] for m in mine]),
            "min_prompt_speedup": min(m["speedup"] for m in mine),
            "acceptance": (sum(m["acceptance"] * m["drafted"] for m in mine if m["drafted"])
                           / drafted if drafted else float("nan")),
            "tokens_per_forward": (sum(m["new_tokens"] - 1 for m in mine)
                                   / max(sum(m["forwards"] for m in mine), 1)),
            "greedy_identical": all(m["greedy_identical"] for m in mine)})
    return out


def _batched_row(model, tok, config, variants, stops):
    """Rows of both categories in one batch: each accepts its own number per step."""
    repetitive, free_form = scored_prompts(config)  # test prompts
    texts = (repetitive[:config.batch_rows // 2] +
             free_form[:config.batch_rows - config.batch_rows // 2])
    ids = [_ids(tok, t) for t in texts]
    drafter, policy = variants["lookup_adaptive"]
    fns = {"plain": lambda: generate(model, ids, max_new_tokens=config.max_new_tokens,
                                     stop_tokens=stops),
           "lookup_adaptive": _spec_fn(model, ids, drafter, policy, config.max_new_tokens,
                                       stops)}
    outs = {n: f() for n, f in fns.items()}
    times = _time_interleaved(fns, config.repeats)
    spec = outs["lookup_adaptive"]
    st = spec.stats
    per_row = [round((len(t) - 1) / max(a, 1), 2) for t, a in zip(spec.tokens, st.active_steps)]
    return {"batch": len(ids), "speedup": _paired_speedup(times, "lookup_adaptive"),
            "cpu_speedup": _paired_speedup(times, "lookup_adaptive", "cpu_s"),
            "greedy_identical": spec.tokens == outs["plain"].tokens,
            "tokens_per_forward_per_row": per_row, "acceptance": st.acceptance_rate}


def _dev_report(config, rows, summary, costs) -> common.Report:
    """The policy choice: the grid entry with the best geometric-mean speedup in process
    CPU time (plain / variant, same round; insensitive to other jobs on a shared machine)
    over every dev prompt (both categories); config.policy must be that entry."""
    by_variant = {}
    for r in rows:
        if r["variant"] != "plain":
            by_variant.setdefault(r["variant"], []).append(r["cpu_speedup"])
    score = {v: geomean(s) for v, s in by_variant.items()}
    best = max(score, key=score.get)
    chosen = _grid_name(config.policy.to_dict())
    claims = [common.claim("dev: config.policy is the grid entry with the best geomean CPU-"
                           "time speedup over all dev prompts", best,
                           f"{chosen}; " + ", ".join(f"{v}: {x:.3f}x" for v, x in
                                                     score.items()), chosen == best)]
    columns = ["category", "prompt", "variant", "prompt_tokens", "new_tokens", "acceptance",
               "tokens_per_forward", "branches", "wall_s", "speedup", "cpu_speedup",
               "greedy_identical"]
    return common.Report(columns=columns, rows=rows, claims=claims,
                         title="Speculative decoding, DEV prompts: draft-length policy grid",
                         extra={"summary": summary, "geomean_speedup": score,
                                "step_costs": costs}, plot=_plot(summary, costs),
                         notes=[f"dev prompts of prompts.py; {config.repeats} interleaved "
                                "rounds per prompt after a warm-up; speedup = median over "
                                "rounds of plain wall / variant wall in the same round"])


def _tiny_exactness(config):
    """Small-vocabulary random model: sampled joint law of 3 tokens vs exact enumeration."""
    from research.model import init_params, make_model, tiny_config
    cfg = tiny_config(vocab_size=6)
    params = init_params(cfg, jax.random.key(config.seed))
    params = jax.tree.map(lambda x: 1.5 * x if x.ndim >= 2 else x, params)
    params["embed"] = params["embed"] * 0.1  # spread-out next-token distributions
    model = make_model(cfg, params)
    noisy = model.replace(params=jax.tree.map(
        lambda x: x * (1 + 0.4 * np.random.default_rng(1).standard_normal(x.shape)
                       ).astype(x.dtype) if x.ndim >= 2 else x, model.params))
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    sampling = SamplingConfig(temperature=1.0, top_k=4, top_p=0.95)
    law = exact_sequence_law(model, prompt, sampling, 3)
    out = {}
    for name, drafter in [("prompt_lookup", prompt_lookup()),
                          ("draft_model", model_drafter(noisy))]:
        gen = speculative_generate(
            model, [prompt] * config.stat_test.tiny_samples, drafter=drafter,
            max_new_tokens=5, key=jax.random.key(config.seed + 1), sampling=sampling,
            policy=DraftLengthPolicy(draft_lengths=(0, 2), adaptive=False))
        out[name] = {"pvalue": chisquare_pvalue([t[:3] for t in gen.tokens], law),
                     "acceptance": gen.stats.acceptance_rate,
                     "samples": config.stat_test.tiny_samples}
    return out


def _smollm2_exactness(model, tok, config):
    """SmolLM2: joint law of the first two sampled tokens (top-k support) vs enumeration;
    the second token comes out of a verify step (accepted draft or resampled residual)."""
    prompt = tok.encode("one two three, one two three, one two three, one two")
    s = config.stat_test
    sampling = SamplingConfig(temperature=s.temperature, top_k=s.top_k)
    law = exact_sequence_law(model, prompt, sampling, 2)
    gen = speculative_generate(model, [prompt] * s.smollm2_samples, drafter=prompt_lookup(),
                               max_new_tokens=3, key=jax.random.key(config.seed + 2),
                               sampling=sampling,
                               policy=DraftLengthPolicy(draft_lengths=(0, 1), adaptive=False))
    return {"pvalue": chisquare_pvalue([t[:2] for t in gen.tokens], law),
            "acceptance": gen.stats.acceptance_rate, "samples": s.smollm2_samples,
            "support": len(law)}


def _plot(summary, costs):
    def draw(fig):
        ax1, ax2 = fig.subplots(1, 2)
        labels = [f"{r['category']}\n{r['variant']}" for r in summary]
        ax1.bar(range(len(summary)), [r["speedup"] for r in summary], color="tab:blue")
        ax1.axhline(1.0, color="k", lw=0.8)
        ax1.set_xticks(range(len(summary)), labels, fontsize=6, rotation=30)
        ax1.set_ylabel("wall speedup vs plain decoding")
        for name, c in costs.items():
            ax2.plot(c["k"], c["relative"], "o-", label=f"{name} measured")
            ax2.plot(c["k"], c["linear_fit"], "--", label=f"{name} fit")
        ax2.set_xlabel("draft length k")
        ax2.set_ylabel("step cost / plain step")
        ax2.legend(fontsize=7)
    return draw


def run(config, out_dir=None) -> common.Report:
    model, tok = load(config.gguf_path or None)
    stops = default_stop_tokens(tok)
    longest = max(len(_ids(tok, t)) for t in sum(scored_prompts(config), ()))
    max_len = round_up(longest + config.max_new_tokens, PAD_BUCKET)
    costs = _cost_curves(model, config, max_len)
    variants = _variants(config, costs)
    exit_variant = {f"early_exit{config.early_exit_layers}_adaptive": (
        early_exit(config.early_exit_layers), DraftLengthPolicy(
            draft_lengths=tuple(config.early_exit_draft_lengths),
            costs=tuple(costs["early_exit"]["linear_fit"])))}
    rows = _prompt_rows(model, tok, config, variants, exit_variant, stops)
    summary = _summary(rows)
    if config.split == "dev":
        return _dev_report(config, rows, summary, costs)
    batched = _batched_row(model, tok, config, variants, stops) if config.batch_rows else None
    tiny = _tiny_exactness(config)
    real = _smollm2_exactness(model, tok, config)

    def pick(cat, var):
        return next(r for r in summary if r["category"] == cat and r["variant"] == var)

    rep, free = pick("repetitive", "lookup_adaptive"), pick("free_form", "lookup_adaptive")
    spec_rows = [r for r in rows if r["variant"] != "plain"]
    identical = sum(r["greedy_identical"] for r in spec_rows)
    claims = [
        common.claim("greedy output identical to plain greedy", "all runs",
                     f"{identical}/{len(spec_rows)} runs" + (
                         f" + batched: {batched['greedy_identical']}" if batched else ""),
                     identical == len(spec_rows) and (not batched or
                                                      batched["greedy_identical"])),
        common.claim("sampling law = target law (tiny V=6, chi-square p)", "p > 1e-3",
                     ", ".join(f"{k}: p={v['pvalue']:.3f}" for k, v in tiny.items()),
                     all(v["pvalue"] > 1e-3 for v in tiny.values())),
        common.claim("sampling law = target law (SmolLM2 2 tokens, top-k)", "p > 1e-3",
                     f"p={real['pvalue']:.3f} (n={real['samples']})", real["pvalue"] > 1e-3),
        common.claim("wall speedup, repetitive (prompt lookup, adaptive)", ">= 1.5x",
                     f"{rep['speedup']:.2f}x (CPU time {rep['cpu_speedup']:.2f}x)",
                     rep["speedup"] >= 1.5),
        common.claim("wall speedup, free-form (prompt lookup, adaptive)", ">= 0.95x",
                     f"{free['speedup']:.2f}x (CPU time {free['cpu_speedup']:.2f}x; worst "
                     f"prompt {free['min_prompt_speedup']:.2f}x)", free["speedup"] >= 0.95),
    ]
    columns = ["category", "prompt", "variant", "prompt_tokens", "new_tokens", "acceptance",
               "tokens_per_forward", "branches", "wall_s", "speedup", "cpu_speedup",
               "greedy_identical"]
    return common.Report(
        columns=columns, rows=rows, title="Speculative decoding on SmolLM2-135M-Instruct",
        claims=claims,
        extra={"summary": summary, "step_costs": costs, "batched": batched,
               "exactness_tiny": tiny, "exactness_smollm2": real, "max_len": max_len},
        plot=_plot(summary, costs),
        notes=[f"test prompts: the {config.get('test_prompts', 'original')!r} set of "
               "prompts.py",
               f"{jax.default_backend()}; greedy; max_new_tokens={config.max_new_tokens}; "
               f"{config.repeats} rounds after a warm-up, variants interleaved in alternating "
               "order; speedup = median over rounds of plain wall / variant wall in the same "
               "round (prefill included in both); cpu_speedup: the same with process CPU "
               "time (insensitive to other jobs on a shared machine); wall_s: median",
               "summary (geometric mean over prompts): " + "; ".join(
                   f"{r['category']}/{r['variant']}: {r['speedup']:.2f}x wall, "
                   f"{r['cpu_speedup']:.2f}x CPU, acceptance "
                   f"{r['acceptance']:.2f}, {r['tokens_per_forward']:.2f} tokens/forward"
                   for r in summary),
               "measured step cost vs k (relative to a plain step; linear fit used by the "
               "adaptive policy): " + "; ".join(
                   f"{n}: " + ", ".join(f"k{k}={x:.2f}" for k, x in zip(c["k"], c["relative"]))
                   for n, c in costs.items())] + ([
               f"batched ({batched['batch']} rows, both categories): "
               f"{batched['speedup']:.2f}x, tokens/forward per row "
               f"{batched['tokens_per_forward_per_row']}, identical: "
               f"{batched['greedy_identical']}"] if batched else []))
