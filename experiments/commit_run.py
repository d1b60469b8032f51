r"""Commit runs from a workdir under results/: the one step that writes there.

    python -m experiments.commit_run baseline_small [more runs] [--workdir=DIR] [--force]
    python -m experiments.commit_run --workdir=DIR          # ledger records only

`experiments.run` writes `<workdir>/<run>/` and the run's ledger records
`<workdir>/ledger/` (default workdir: $SERVAX_WORKDIR, else runs/ in this checkout). This
copies the committed files of each run (results.json, table.md, plot.png; checkpoints and
traces stay in the workdir) into `results/<run>/`, then merges every ledger record of the
workdir into results/ledger/ (experiments/protocol.py `merge_ledgers`): all of them, the
records of runs not committed and of aborted runs included, since a scoring counts whether
its numbers are kept or not. Merging is idempotent (records are matched by id).

A committed run made at another git commit is not overwritten unless --force: its numbers
are cited, and replacing them is a decision. A test run whose counts did not read the
committed ledger (`experiments.run --ledger_base=none` or another folder) is refused, with
or without --force: its "re-scored" counts would miss the committed records (issue 45).
Nothing is committed to git; the command prints what to `git add`.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from experiments import common, protocol


class CommitError(ValueError):
    """A run that cannot be committed (missing, would overwrite another commit's run, its
    counts did not read the committed ledger, or its item record is missing)."""


def _commit_of(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / "results.json").read_text())["git"]["commit"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check(run: str, workdir: Path, results_dir: Path, force: bool = False) -> list[str]:
    """Why `run` cannot be committed as is (CommitError), else warnings to print."""
    if not run or "/" in run or run in (".", "..", "ledger"):
        raise CommitError(f"{run!r} is not a run name")
    src, dst = workdir / run, results_dir / run
    if not (src / "results.json").is_file():
        raise CommitError(f"{src}/results.json does not exist: run it first "
                          f"(python -m experiments.run ... --workdir={workdir})")
    payload = json.loads((src / "results.json").read_text())
    new = (payload.get("git") or {}).get("commit")
    warnings = _ledger_checks(run, payload, workdir, results_dir)
    if (payload.get("git") or {}).get("dirty"):
        warnings.append(f"{run}: run from a tree with uncommitted changes "
                        f"({payload['git'].get('dirty_count')} path(s)); its commit "
                        f"{(new or '?')[:12]} alone does not reproduce it")
    if (dst / "results.json").is_file():
        old = _commit_of(dst)
        if old != new and not force:
            raise CommitError(
                f"results/{run}/ was run at commit {(old or '?')[:12]}, this run at "
                f"{(new or '?')[:12]}: not overwritten (--force to replace it)")
        if old != new:
            warnings.append(f"{run}: replacing the run of commit {(old or '?')[:12]}")
    return warnings


def _ledger_checks(run: str, payload: dict, workdir: Path, results_dir: Path) -> list[str]:
    """CommitError for a test run whose counts did not read the ledger it is committed to
    (`--ledger_base=none` or another folder: its "re-scored" counts miss the committed
    records) or whose item-ledger record is in neither ledger (its scoring would go
    unrecorded); warnings for a run made before the runner recorded its ledger base."""
    block = payload.get("protocol") or {}
    if block.get("split") != "test":
        return []  # a dev run counts nothing
    committed = (results_dir / "ledger").resolve()
    out = []
    if "ledger_base" not in block:
        out.append(f"{run}: made before the runner recorded which ledger its counts read "
                   "(issue 45): not checked that they read the committed one")
    else:
        base = block["ledger_base"]
        ok = ((base == protocol.COMMITTED_BASE
               and results_dir.resolve() == common.RESULTS_DIR.resolve())
              or (base not in (None, protocol.COMMITTED_BASE)
                  and Path(base).resolve() == committed))
        if not ok:
            made = ("--ledger_base=none (its workdir's records alone)" if base is None
                    else f"--ledger_base={base}")
            raise CommitError(
                f"{run} was run with {made}, not the committed ledger {committed}: its "
                "re-scored counts miss the committed records, so it cannot be committed; "
                "rerun it without --ledger_base (its records in the workdir's ledger are "
                f"still merged by: python -m experiments.commit_run --workdir={workdir})")
    items = block.get("items") or {}
    sid, technique = items.get("scoring_id"), block.get("technique")
    if sid and technique:
        held = [r["id"] for d in (workdir / "ledger", results_dir / "ledger")
                for r in protocol.read_item_ledger(technique, d)["scorings"]]
        if sid not in held:
            raise CommitError(
                f"{run}: its item-ledger record {sid} is in neither {workdir}/ledger nor "
                f"{results_dir}/ledger: its test items would go unrecorded")
    return out


def copy_run(run: str, workdir: Path, results_dir: Path) -> list[str]:
    """Copy the committed files of `<workdir>/<run>/` into `<results_dir>/<run>/` (removing
    a committed file the new run does not have, e.g. a plot); returns the copied paths."""
    src, dst = workdir / run, results_dir / run
    dst.mkdir(parents=True, exist_ok=True)
    out = []
    for name in common.COMMITTED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            out.append(str(dst / name))
        elif (dst / name).exists():
            (dst / name).unlink()
    return out


def commit(runs: list[str], workdir: Path | str | None = None,
           results_dir: Path | str | None = None, force: bool = False) -> list[str]:
    """Check every run first (nothing is written when one is refused), then copy them and
    merge the workdir's ledger records into `<results_dir>/ledger/`. Returns a log."""
    workdir = Path(workdir) if workdir else common.default_workdir()
    results_dir = Path(results_dir) if results_dir else common.RESULTS_DIR
    if workdir.resolve() == results_dir.resolve():
        raise CommitError("the workdir is results/ itself: nothing to commit")
    log = []
    for run in runs:
        log += [f"warning: {w}" for w in check(run, workdir, results_dir, force)]
    for run in runs:
        log += [f"copied {p}" for p in copy_run(run, workdir, results_dir)]
    merged = protocol.merge_ledgers(workdir / "ledger", results_dir / "ledger")
    log += [f"merged {m}" for m in merged] or ["ledger: no new records"]
    return log


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.commit_run",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", help="run names (folders of the workdir)")
    ap.add_argument("--workdir", default=None,
                    help="default: $SERVAX_WORKDIR, else runs/ in this checkout")
    ap.add_argument("--results_dir", default=None, help=argparse.SUPPRESS)  # tests
    ap.add_argument("--force", action="store_true",
                    help="overwrite a committed run made at another git commit")
    args = ap.parse_args(argv)
    try:
        log = commit(args.runs, args.workdir, args.results_dir, args.force)
    except CommitError as e:
        print(f"commit_run: {e}", file=sys.stderr)
        return 1
    print("\n".join(log))
    paths = " ".join([f"results/{r}" for r in args.runs] + ["results/ledger"])
    print(f"now: git add {paths} && git commit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
