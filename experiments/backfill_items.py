r"""Back-fill the item ledger's re-scored counts into results written before it existed.

Command:  python -m experiments.backfill_items            (every results/<run>/ without them)
          python -m experiments.backfill_items RUN [RUN ...]

A run made before the item ledger (experiments/protocol.py; docs/protocol.md "The item
ledger") has no results.json["protocol"]["items"]. Its test items are in the item ledger
all the same (seeded from the run ledgers and the known leaks), and each record says when
its scorings were made (`protocol.scoring_times`), so the counts the run would have
reported had the ledger existed are those of the records made *before* the run's last
scoring (the one its results.json holds). This writes that block (marked "backfilled"),
adds " re-scored (k)" to each claim's measured value when k > 0 and puts the same in
table.md with its protocol line. A dev run gets items None and the dev line; a run made
before the dev/test protocol (no protocol block) gets its module's items, dated by its
results' first commit. Idempotent: a run that already has the block is left alone,
except a run that declared only its run item when its module lists its items now
(serving_harness_small, issue 45): its block is recomputed for those items, counting the
records made before it started, marked "corrected", the run-time block kept beside it.
"""
from __future__ import annotations

import datetime
import importlib
import json
import subprocess
import sys
from pathlib import Path

from ml_collections import ConfigDict

from experiments import common, protocol


def _run_record(run_name: str, ledger_dir: Path) -> tuple[str, dict, dict]:
    """(technique, the run's own seeded item-ledger record, that item ledger)."""
    for led in protocol.item_ledgers(ledger_dir):
        for rec in led["scorings"]:
            if protocol.record_run(rec) == run_name:
                return led["technique"], rec, led
    raise ValueError(f"{run_name}: no seeded record in the item ledgers of {ledger_dir} "
                     "(python -m experiments.protocol seed)")


def items_block(run_name: str, ledger_dir: Path | str | None = None) -> dict:
    """results.json["protocol"]["items"] for a run older than the item ledger: its items'
    earlier scorings, counting only the records made before its last scoring."""
    ledger_dir = Path(ledger_dir or protocol.LEDGER_DIR)
    technique, rec, led = _run_record(run_name, ledger_dir)
    run_times = protocol.run_ledger_times(ledger_dir)
    times = protocol.scoring_times(rec, run_times)
    if not rec.get("items") or not times[-1]:
        raise ValueError(f"{run_name}: its record holds no items or no run-ledger time")
    last = times[-1]
    items = [protocol.Item.from_json(k, led["items"][k]) for k in rec["items"]]
    return _counted_block(technique, run_name, rec["id"], items,
                          rec.get("use", protocol.SCORED), last, ledger_dir,
                          "the run's last scoring); the run itself predates the item ledger",
                          run_times)


def pre_protocol_items_block(run_dir: Path, payload: dict,
                             ledger_dir: Path | str | None = None) -> dict:
    """The items block of a run made before the dev/test protocol (no run-ledger record):
    its module's `test_items` for its config, counted against the records made before
    its results were first committed (git)."""
    config = ConfigDict(payload["config"])
    module = importlib.import_module(config.experiment)
    items = protocol.list_test_items(module, config)
    when = subprocess.run(["git", "log", "--reverse", "--format=%cI", "--",
                           str(run_dir / "results.json")], capture_output=True, text=True,
                          cwd=run_dir, check=True).stdout.split()
    if not when:
        raise ValueError(f"{run_dir}: results.json is not committed; cannot date the run")
    last = datetime.datetime.fromisoformat(when[0]).astimezone(
        datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return _counted_block(module.TECHNIQUE, config.run_name, "pre-protocol", items,
                          getattr(module, "TEST_ITEMS_USE", protocol.SCORED), last,
                          ledger_dir, "its results' first commit); the run predates the "
                          "protocol and is in no ledger")


def _counted_block(technique: str, run_name: str, scoring_id: str, items: list, use: str,
                   before: str, ledger_dir, why: str, run_times: dict | None = None) -> dict:
    """The items block of `items`, counting the records made before `before` (`run_times`:
    the run ledgers' times, read here when the caller has not read them)."""
    times = protocol.run_ledger_times(ledger_dir) if run_times is None else run_times
    scored = protocol.prior_counts(items, ledger_dir, before=before, run_times=times)
    load = protocol.prior_counts(items, ledger_dir, use=protocol.LOAD, before=before,
                                 run_times=times)
    block = protocol.Declaration(
        technique, run_name, scoring_id, items, [c["prior"] for c in scored],
        [c["by_technique"].get(technique, 0) for c in scored], [],
        [c["by_technique"] for c in scored], [c["prior"] for c in load],
        use).block("completed")
    block["backfilled"] = ("computed after the run by python -m experiments.backfill_items "
                           f"from the item ledger's records made before {before} ({why}")
    return block


def _claim_row(claim: dict) -> str:
    return "| " + " | ".join(common.fmt(claim.get(c, ""))
                             for c in ("claim", "target", "measured", "met")) + " |"


def _live_record(scoring_id: str, ledger_dir) -> dict:
    for led in protocol.item_ledgers(ledger_dir):
        for rec in led["scorings"]:
            if rec["id"] == scoring_id:
                return rec
    raise ValueError(f"no item-ledger record {scoring_id} in {ledger_dir}")


def listed_later(payload: dict) -> list | None:
    """The items of a run that declared only its run item (its module listed no items at
    the time) when its module lists them now (e.g. serving_harness_small's 24 corpus
    paragraphs, issue 45); None otherwise."""
    items = (payload.get("protocol") or {}).get("items") or {}
    if items.get("kinds") != ["run"] or "corrected" in items:
        return None
    config = ConfigDict(payload["config"])
    listed = protocol.list_test_items(importlib.import_module(config.experiment), config)
    return None if any(i.kind == "run" for i in listed) else listed


def correct(run_dir: Path, payload: dict, items: list,
            ledger_dir: Path | str | None = None) -> str:
    """Replace the items block of a run that declared only its run item by the block of
    the items it did score (`listed_later`), counted against the records made before its
    own record started; the block made at run time is kept as "declared_at_run"."""
    ledger_dir = Path(ledger_dir or protocol.LEDGER_DIR)
    old = payload["protocol"]["items"]
    config = ConfigDict(payload["config"])
    module = importlib.import_module(config.experiment)
    started = _live_record(old["scoring_id"], ledger_dir)["started_utc"]
    block = _counted_block(module.TECHNIQUE, config.run_name, old["scoring_id"], items,
                           getattr(module, "TEST_ITEMS_USE", protocol.SCORED), started,
                           ledger_dir, "the run's start); the run declared only its run "
                           "item, its module lists its items since")
    block["corrected"] = block.pop("backfilled")
    block["declared_at_run"] = old
    return _write(run_dir, payload, payload["protocol"], block,
                  replace=protocol.rescored_line(old))


def backfill(run_dir: Path, ledger_dir: Path | str | None = None) -> str:
    """Write the block into `run_dir`'s results.json and table.md; returns a log line. A
    run that has its block already is left alone, unless it declared only its run item
    and its module lists its items now (`correct`)."""
    path = run_dir / "results.json"
    payload = json.loads(path.read_text())
    block = payload.get("protocol")
    if block is not None and "items" in block:
        listed = listed_later(payload)
        if listed is not None:
            return correct(run_dir, payload, listed, ledger_dir)
        return f"{run_dir.name}: has its items block already"
    if block is None:  # made before the dev/test protocol (scaleout_small): no split
        block = {"split": None, "note": "run made before the dev/test protocol: no split, "
                 "no run-ledger record"}
        items = pre_protocol_items_block(run_dir, payload, ledger_dir)
    else:
        items = (items_block(payload["config"]["run_name"], ledger_dir)
                 if block.get("split") == "test" else None)
    return _write(run_dir, payload, block, items)


def _write(run_dir: Path, payload: dict, block: dict, items: dict | None,
           replace: str | None = None) -> str:
    """Put `items` into results.json["protocol"] and its protocol line and re-scored
    claims into results.json and table.md (`replace`: the protocol line it supersedes,
    removed from both)."""
    path = run_dir / "results.json"
    table_path = run_dir / "table.md"
    table = table_path.read_text() if table_path.exists() else None
    before = [_claim_row(c) for c in payload.get("claims", [])]
    report = common.Report(columns=payload.get("columns", []), rows=payload.get("rows", []),
                           claims=payload.get("claims", []), notes=[])
    protocol.annotate_report(report, items)
    notes = [n for n in payload.get("notes", []) if n != replace]
    if table is not None:  # a few early dev runs wrote results.json only
        for old, claim in zip(before, report.claims):
            if old != (new := _claim_row(claim)):
                if table.count(old) != 1:
                    raise ValueError(f"{table_path}: claim row not found once: {old}")
                table = table.replace(old, new)
        if replace is not None:
            if table.count(f"- {replace}\n") != 1:
                raise ValueError(f"{table_path}: protocol line not found once: {replace}")
            table = table.replace(f"- {replace}\n", "")
        table = table.rstrip("\n") + "\n" + "".join(f"- {n}\n" for n in report.notes)
        table_path.write_text(table)
    payload["protocol"] = {**block, "items": items}
    payload["notes"] = notes + report.notes
    path.write_text(json.dumps(payload, indent=2))
    return f"{run_dir.name}: {report.notes[-1]}"


def main(argv: list[str]) -> None:
    results = common.RESULTS_DIR
    runs = ([results / r for r in argv] if argv else
            sorted(p.parent for p in results.glob("*/results.json")))
    for run_dir in runs:
        print(backfill(run_dir))


if __name__ == "__main__":
    main(sys.argv[1:])
