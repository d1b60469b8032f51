r"""The one entry point for servax experiments.

    python -m experiments.run --config=experiments/baseline/baseline.py:small

The config file's `get_config(arg)` returns an ml_collections ConfigDict whose
`experiment` names a module with `run(config, out_dir) -> Report`. Results go to
`out_dir = <workdir>/<config.run_name>/`: results.json, table.md, plot.png, plus any
artifacts the experiment writes there (checkpoints, traces); the table is printed.
Global JAX settings (x64, matmul precision, host device count) are set here only.

The workdir (--workdir; default $SERVAX_WORKDIR, else runs/ in this checkout, ignored by
git) also holds the run's ledger records, `<workdir>/ledger/`: a test run's counts read
the committed ledger (--ledger_base, results/ledger/) and the workdir's together, and the
run writes to the workdir's only. Nothing under results/ changes; committing a run there is
its own step, `python -m experiments.commit_run <run_name>` (docs/protocol.md).
"""
from __future__ import annotations

import difflib
import importlib
import os
import sys
import time
from pathlib import Path
from typing import Sequence

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file[:arg]",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "where the result folder <workdir>/<run_name>/ and the run's ledger "
    "records <workdir>/ledger/ are written (default: $SERVAX_WORKDIR, else runs/ in this "
    "checkout, ignored by git); `python -m experiments.commit_run` copies a run to results/")
_LEDGER_BASE = flags.DEFINE_string(
    "ledger_base", None, "the committed ledger whose records count as prior scorings (read "
    "only; default results/ledger/ of this checkout; 'none' counts the workdir's alone: "
    "for trying things out, since experiments.commit_run refuses a test run that did not "
    "read the committed ledger)")
_HOST_DEVICES = flags.DEFINE_integer(
    "host_devices", None, "simulate this many CPU devices (XLA host platform); "
    "defaults to config.host_devices when the config has it")


def unknown_override(config, argv: Sequence[str]) -> str | None:
    """A one-line error for the first `--config.<path>=...` in `argv` whose path is not in
    `config` (with the closest existing keys), or None when every path exists."""
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        path = arg[len("--config."):].split("=", 1)[0]
        node, done = config, []
        for part in path.split("."):
            where = ".".join(done) or "the config"
            if not hasattr(node, "keys"):
                return (f"unknown config key {path!r} in --config.{path}: {where} is a leaf of "
                        f"type {type(node).__name__}, not a group of keys")
            keys = list(node.keys())
            if part not in keys:
                close = difflib.get_close_matches(part, keys, n=3)
                hint = ("did you mean " + " or ".join(repr(".".join(done + [c])) for c in close)
                        + "?" if close else f"{where} has {', '.join(sorted(keys))}")
                return f"unknown config key {path!r} in --config.{path}: {hint}"
            node, done = node[part], done + [part]
    return None


def _parse_flags(argv):
    """absl's flag parsing, but an unknown `--config.<key>` is a one-line error naming the
    key (ml_collections raises a bare AttributeError from inside flag parsing)."""
    try:
        return app.parse_flags_with_usage(argv)
    except (AttributeError, KeyError):
        message = None
        try:
            value = flags.FLAGS["config"].parser.parse(_config_arg(argv))
            message = unknown_override(value, argv)
        except Exception:  # noqa: BLE001 - fall back to the original error below
            pass
        if message is None:
            raise
        sys.stderr.write(f"FATAL Flags parsing error: {message}\n")
        sys.exit(1)


def _config_arg(argv: Sequence[str]) -> str:
    values = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    if not values:
        raise ValueError("no --config=<file> in argv")
    return values[-1]


def _set_platform_flags(config) -> None:
    n = _HOST_DEVICES.value or config.get("host_devices", None)
    if n:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={int(n)}")


def main(argv) -> None:
    del argv
    config = _CONFIG.value
    if config is None:
        raise app.UsageError("--config=experiments/<name>/<run>.py:<small|full> is required")
    for key in ("experiment", "run_name", "seed"):
        if key not in config:
            raise app.UsageError(f"config is missing the required key {key!r}")
    _set_platform_flags(config)
    import jax  # after XLA_FLAGS are final
    jax.config.update("jax_default_matmul_precision", config.get("matmul_precision",
                                                                  "highest"))
    from experiments import common, protocol
    module = importlib.import_module(config.experiment)
    protocol.validate(module, config)  # the dev/test protocol: refuse before running
    logging.info("running %s (%s)", config.run_name, config.experiment)
    workdir = Path(_WORKDIR.value) if _WORKDIR.value else common.default_workdir()
    out_dir = workdir / config.run_name
    out_dir.mkdir(parents=True, exist_ok=True)
    git = common.git_state()  # before the run: the code that runs, not edits made meanwhile
    command = ["python", "-m", "experiments.run", *sys.argv[1:]]  # not this machine's path
    # the run's ledger records go beside its result folder: <workdir>/ledger/<technique>.json
    # (runs) and items_<technique>.json (test items, written before scoring); the committed
    # ledger (results/ledger/) is read for the prior counts, never written
    ledger_dir = workdir / "ledger"
    base = _LEDGER_BASE.value
    base_ledger_dir = (None if base == "none" else Path(base) if base
                       else protocol.LEDGER_DIR)
    declared = protocol.begin_test_run(module, config, commit=git.get("commit"),
                                       ledger_dir=ledger_dir,
                                       base_ledger_dir=base_ledger_dir)
    if declared is not None:
        logging.info("declared %d test items (%d scored before)", len(declared.items),
                     sum(p > 0 for p in declared.prior))
    t0 = time.perf_counter()
    report = module.run(config, out_dir)
    elapsed = time.perf_counter() - t0
    if declared is not None:
        protocol.complete_test_items(declared, ledger_dir=ledger_dir)
    block = protocol.protocol_block(
        module, config, commit=git.get("commit"), ledger_dir=ledger_dir,
        base_ledger_dir=base_ledger_dir,
        run_id=declared.scoring_id if declared is not None else None)
    block["items"] = declared.block("completed") if declared is not None else None
    block["ledger_base"] = protocol.ledger_base_label(base_ledger_dir)  # commit_run checks
    protocol.annotate_report(report, block["items"])
    common.write_results(report, out_dir, config.to_dict(), config.seed, command, elapsed,
                         git=git, protocol=block)
    print(common.render_markdown(report))
    print(f"wrote {out_dir}/results.json, table.md" + (", plot.png" if report.plot else "")
          + f" in {elapsed:.0f}s; {block['split']} split of {block['technique']}"
          + (f", test scorings with these defaults: {block['test_scorings']}; "
             + protocol.rescored_line(block["items"]) if block["split"] == "test" else ""))
    if out_dir.resolve().parent != common.RESULTS_DIR.resolve():
        flag = "" if workdir == common.default_workdir() else f" --workdir={workdir}"
        print(f"results/ is unchanged; to commit this run there (with its ledger records): "
              f"python -m experiments.commit_run {config.run_name}{flag}")


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
