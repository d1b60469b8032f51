r"""Dev sweep: task difficulty and search temperature for SpecScale, on the DEV split only.

    python -m experiments.run --config=experiments/specscale/dev/difficulty.py \
        [--config.n=16] [--config.settings=2x1digit,3x2digit] [--config.temperatures=0.5]

For each (n_steps, start range, operand range, temperature): greedy, one sample, and beam
search 2x4 with the likelihood + exact process verifiers, on `n` dev problems (seed 1000,
problems whose content hashes into the dev split). A dev run of `experiments.run`
(config.split = "dev": recorded as such in results.json["protocol"], never counted in the
test ledgers); results go to `<workdir>/specscale_dev_difficulty/` (the committed
results/specscale_dev_2x1digit/ is `--config.settings=2x1digit
--config.run_name=specscale_dev_2x1digit`). The test split is never touched.
"""
from __future__ import annotations

import time

import ml_collections

from experiments import common

SETTINGS = {  # name: (n_steps, start_range, operand_range)
    "2x1digit": (2, (2, 9), (1, 9)),  # the pre-protocol task
    "3x2digit": (3, (10, 99), (10, 99)),
    "3x1digit": (3, (10, 99), (2, 9)),
    "4x1digit": (4, (10, 49), (2, 9)),
}

# the dev/test protocol (experiments/protocol.py): a dev sweep, where defaults are chosen
TECHNIQUE = "specscale"
DEFAULTS_CHOSEN_ON = ("this dev sweep chooses them: python -m experiments.run "
                      "--config=experiments/specscale/dev/difficulty.py")
COLUMNS = ["setting", "temperature", "method", "accuracy", "wall_s", "tokens_computed"]


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg
    c = ml_collections.ConfigDict()
    c.experiment = "experiments.specscale.dev.difficulty"
    c.run_name = "specscale_dev_difficulty"
    c.split = "dev"  # a dev sweep only: `test_items` refuses the test split
    c.seed = 1000
    c.gguf_path = ""  # empty: the embedded SmolLM2-135M-Instruct
    c.n = 16
    c.settings = ",".join(SETTINGS)
    c.temperatures = "0.5"
    c.engine = ml_collections.ConfigDict(dict(n_blocks=4096, block_size=16, max_len=1024))
    return c


def defaults(config) -> dict:
    """The sweep's grid (a dev run: recorded in results.json, counted nowhere)."""
    return {"settings": {n: SETTINGS[n] for n in _settings(config)},
            "temperatures": _temperatures(config), "n": config.n}


def test_items(config):
    raise ValueError(f"{config.experiment} is a dev sweep: config.split must be 'dev'")


def _settings(config) -> list[str]:
    names = [n for n in config.settings.split(",") if n]
    unknown = sorted(set(names) - set(SETTINGS))
    if unknown or not names:
        raise ValueError(f"config.settings: unknown {unknown}; expected some of "
                         f"{sorted(SETTINGS)}")
    return names


def _temperatures(config) -> list[float]:
    return [float(t) for t in str(config.temperatures).split(",") if t]


def run(config, out_dir) -> common.Report:
    del out_dir  # nothing beyond the result files
    if config.split != "dev":
        test_items(config)
    from research.model import load
    from research.specscale import (ArithmeticChains, PagedEngine, SearchContext,
                                    beam_search, run_search, single_sample)
    model, tok = load(config.gguf_path or None)
    rows = []
    for name in _settings(config):
        steps, start, ops = SETTINGS[name]
        task = ArithmeticChains(n_steps=steps, start_range=start, operand_range=ops,
                                n_shots=2, verifier_shots=8)
        problems = task.problems(config.n, seed=config.seed, split="dev")
        for temp in _temperatures(config):
            engine = PagedEngine(model, **config.engine.to_dict(), temperature=temp)
            ctx = SearchContext(engine, tok, task)
            lim = dict(max_lines=steps + 1, max_line_tokens=16)
            for cfg in (single_sample(greedy=True, **lim), single_sample(**lim),
                        beam_search(2, 4, process=True, **lim)):
                t0 = time.perf_counter()
                res = run_search(ctx, problems, cfg, seed=config.seed, group_size=config.n)
                row = {"setting": name, "temperature": temp, "method": cfg.label,
                       "accuracy": res.accuracy, "wall_s": time.perf_counter() - t0,
                       "tokens_computed": res.stats["tokens_computed"]}
                print(row, flush=True)
                rows.append(row)
            ctx.close()
    return common.Report(columns=COLUMNS, rows=rows,
                         title="SpecScale dev sweep: task difficulty x temperature",
                         notes=[f"dev split only: {config.n} dev problems per setting "
                                f"(seed {config.seed})"])


if __name__ == "__main__":
    raise SystemExit("run it through the experiment runner:\n  python -m experiments.run "
                     "--config=experiments/specscale/dev/difficulty.py")
