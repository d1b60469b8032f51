"""The test-scoring ledger: how often each test split was scored since its defaults changed.

The protocol (docs/protocol.md): defaults are chosen on a dev split; the test split is
scored once with the final defaults. Every experiment module declares

    TECHNIQUE = "tasq"                      # the ledger key
    def defaults(config) -> dict: ...       # the settings chosen on dev (library defaults
                                            # included), JSON-serialisable
    DEFAULTS_CHOSEN_ON = "<dev command or results dir>"   # where they were chosen

and a config runs on `config.split` ("test" unless a dev sweep says "dev"). When
`experiments.run` finishes a test run it calls `record_test_scoring`, which updates the
committed ledger file `<workdir>/ledger/<technique>.json` (workdir: results/ by default)
and returns the block written into
results.json["protocol"]:

    {"technique", "split", "run_name", "defaults", "defaults_fingerprint",
     "defaults_chosen_on", "test_scorings": n}

`test_scorings` counts the test runs of this run_name (its test split) since the
fingerprint of the defaults last changed: a changed default resets it, so n = 1 is a test
split scored once with its final defaults, and n > 1 says it was scored again (e.g. a
timing rerun) with the same defaults. A dev run is recorded nowhere.
"""
from __future__ import annotations

import datetime
import hashlib
import json
from pathlib import Path
from typing import Any

LEDGER_DIR = Path(__file__).resolve().parents[1] / "results" / "ledger"
SPLITS = ("dev", "test")


def fingerprint(defaults: dict) -> str:
    """sha256 (first 16 hex digits) of the canonical JSON of `defaults`."""
    if not isinstance(defaults, dict):
        raise TypeError(f"defaults must be a dict, got {type(defaults).__name__}")
    text = json.dumps(_plain(defaults), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _plain(x: Any) -> Any:
    """JSON-ready copy: tuples -> lists, dataclasses/ConfigDicts -> dicts."""
    if hasattr(x, "to_dict"):
        x = x.to_dict()
    if hasattr(x, "__dataclass_fields__"):
        import dataclasses
        x = dataclasses.asdict(x)
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"defaults hold a {type(x).__name__} ({x!r}); use JSON types")


def ledger_path(technique: str, ledger_dir: Path | str | None = None) -> Path:
    if not technique or not technique.replace("_", "").isalnum():
        raise ValueError(f"technique must be a non-empty identifier, got {technique!r}")
    return Path(ledger_dir or LEDGER_DIR) / f"{technique}.json"


def read_ledger(technique: str, ledger_dir: Path | str | None = None) -> dict:
    path = ledger_path(technique, ledger_dir)
    if not path.exists():
        return {"technique": technique, "splits": {}}
    try:
        ledger = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"ledger {path} is not valid JSON ({e}); fix or delete it") from None
    if ledger.get("technique") != technique or not isinstance(ledger.get("splits"), dict):
        raise ValueError(f"ledger {path} is not a ledger of {technique!r}")
    return ledger


def record_test_scoring(technique: str, run_name: str, defaults: dict, *,
                        chosen_on: str, commit: str | None = None,
                        ledger_dir: Path | str | None = None) -> dict:
    """Count one scoring of `run_name`'s test split with `defaults`; returns the protocol
    block for results.json. The count restarts at 1 when the defaults' fingerprint differs
    from the one recorded for this split."""
    if not chosen_on:
        raise ValueError(f"{technique}: chosen_on must say where the defaults were chosen "
                         "(a dev command or results dir)")
    fp = fingerprint(defaults)
    ledger = read_ledger(technique, ledger_dir)
    entry = ledger["splits"].get(run_name)
    if entry is None or entry.get("defaults_fingerprint") != fp:
        entry = {"defaults_fingerprint": fp, "defaults": _plain(defaults),
                 "defaults_chosen_on": chosen_on, "test_scorings": 0, "runs": []}
    entry["test_scorings"] += 1
    entry["defaults_chosen_on"] = chosen_on
    entry["runs"].append({"commit": commit, "utc": datetime.datetime.now(
        datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")})
    ledger["splits"][run_name] = entry
    path = ledger_path(technique, ledger_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ledger, indent=2, sort_keys=True) + "\n")
    return {"technique": technique, "split": "test", "run_name": run_name,
            "defaults": entry["defaults"], "defaults_fingerprint": fp,
            "defaults_chosen_on": chosen_on, "test_scorings": entry["test_scorings"]}


def validate(module, config) -> str:
    """The run's split; ValueError when the module does not declare TECHNIQUE,
    defaults(config) and DEFAULTS_CHOSEN_ON or config.split is not dev/test. Called by
    `experiments.run` before the run, so a run that cannot be recorded does not start."""
    missing = [n for n in ("TECHNIQUE", "defaults", "DEFAULTS_CHOSEN_ON")
               if not hasattr(module, n)]
    if missing:
        raise ValueError(f"experiment module {module.__name__} must declare {missing} (the "
                         "dev/test protocol, experiments/protocol.py)")
    split = config.get("split", "test")
    if split not in SPLITS:
        raise ValueError(f"config.split must be one of {SPLITS}, got {split!r}")
    fingerprint(module.defaults(config))  # JSON-able
    return split


def protocol_block(module, config, *, commit: str | None = None,
                   ledger_dir: Path | str | None = None) -> dict:
    """What `experiments.run` writes into results.json["protocol"] for `module`'s run.

    A test run (config.split == "test", the default) is counted in the ledger; a dev run
    is not. Raises ValueError when the module does not declare TECHNIQUE, defaults(config)
    and DEFAULTS_CHOSEN_ON.
    """
    split = validate(module, config)
    defaults = module.defaults(config)
    if split == "dev":
        return {"technique": module.TECHNIQUE, "split": "dev", "run_name": config.run_name,
                "defaults": _plain(defaults), "defaults_fingerprint": fingerprint(defaults),
                "test_scorings": None}
    return record_test_scoring(module.TECHNIQUE, config.run_name, defaults,
                               chosen_on=module.DEFAULTS_CHOSEN_ON, commit=commit,
                               ledger_dir=ledger_dir)
