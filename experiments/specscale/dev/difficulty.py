r"""Dev sweep: task difficulty and search temperature for SpecScale, on the DEV split only.

    python -m experiments.specscale.dev.difficulty [--n=16] [--settings=...]

For each (n_steps, start range, operand range, temperature): greedy, one sample, and beam
search 2x4 with the likelihood + exact process verifiers, on `n` dev problems (seed 1000,
problems whose content hashes into the dev split). Writes
results/specscale_dev_difficulty/results.json. The test split is never touched.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from experiments import common
from research.model import load
from research.specscale import (ArithmeticChains, PagedEngine, SearchContext, beam_search,
                                run_search, single_sample)

SETTINGS = {  # name: (n_steps, start_range, operand_range)
    "2x1digit": (2, (2, 9), (1, 9)),  # the pre-protocol task
    "3x2digit": (3, (10, 99), (10, 99)),
    "3x1digit": (3, (10, 99), (2, 9)),
    "4x1digit": (4, (10, 49), (2, 9)),
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--temperatures", default="0.5")
    ap.add_argument("--out", default="results/specscale_dev_difficulty")
    args = ap.parse_args(argv)
    git = common.git_state()
    t_start = time.perf_counter()
    model, tok = load(None)
    rows = []
    for name in args.settings.split(","):
        steps, start, ops = SETTINGS[name]
        task = ArithmeticChains(n_steps=steps, start_range=start, operand_range=ops,
                                n_shots=2, verifier_shots=8)
        problems = task.problems(args.n, seed=1000, split="dev")
        for temp in (float(t) for t in args.temperatures.split(",")):
            engine = PagedEngine(model, n_blocks=4096, block_size=16, max_len=1024,
                                 temperature=temp)
            ctx = SearchContext(engine, tok, task)
            lim = dict(max_lines=steps + 1, max_line_tokens=16)
            for cfg in (single_sample(greedy=True, **lim), single_sample(**lim),
                        beam_search(2, 4, process=True, **lim)):
                t0 = time.perf_counter()
                res = run_search(ctx, problems, cfg, seed=1000, group_size=args.n)
                row = {"setting": name, "temperature": temp, "method": cfg.label,
                       "accuracy": res.accuracy, "wall_s": time.perf_counter() - t0,
                       "tokens_computed": res.stats["tokens_computed"]}
                print(json.dumps(row), flush=True)
                rows.append(row)
            ctx.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({
        "command": "python -m experiments.specscale.dev.difficulty " + " ".join(
            sys.argv[1:] if argv is None else argv), "git": git, "split": "dev",
        "config": vars(args), "seed": 1000, "rows": rows, "versions": common.versions(),
        "elapsed_s": round(time.perf_counter() - t_start, 1),
        "protocol": {"technique": "specscale", "split": "dev", "test_scorings": None}},
        indent=2))


if __name__ == "__main__":
    main()
