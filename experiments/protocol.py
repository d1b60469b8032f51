"""The test-scoring ledger: how often each test split was scored since its defaults changed.

The protocol (docs/protocol.md): defaults are chosen on a dev split; the test split is
scored once with the final defaults. Every experiment module declares

    TECHNIQUE = "tasq"                      # the ledger key
    def defaults(config) -> dict: ...       # the settings chosen on dev (library defaults
                                            # included), JSON-serialisable
    DEFAULTS_CHOSEN_ON = "<dev command or results dir>"   # where they were chosen

and a config runs on `config.split` ("test" unless a dev sweep says "dev"). When
`experiments.run` finishes a test run it calls `record_test_scoring`, which appends the
run to the workdir's ledger `<workdir>/ledger/<technique>.json` and returns the block
written into results.json["protocol"]:

    {"technique", "split", "run_name", "defaults", "defaults_fingerprint",
     "defaults_chosen_on", "test_scorings": n}

`test_scorings` counts the test runs of this run_name (its test split) since the
fingerprint of the defaults last changed: a changed default resets it, so n = 1 is a test
split scored once with its final defaults, and n > 1 says it was scored again (e.g. a
timing rerun) with the same defaults. A dev run is recorded nowhere.

The item ledger (below; docs/protocol.md "The item ledger"): every test item a run scores,
whatever its name or defaults, in `<workdir>/ledger/items_<technique>.json`, declared by
`begin_test_run` before the run scores anything (from the module's `test_items(config)`)
and completed after; results.json["protocol"]["items"] says how many were re-scored.

Two ledger folders (docs/protocol.md "Using it"): the committed ledger LEDGER_DIR
(results/ledger/, read only during a run) and a workdir's ledger (`<workdir>/ledger/`,
where a run writes). A run's counts are those of both together (`base_ledger_dir` = the
committed one): the workdir holds only the records made there, each with an id, and
`merge_ledgers` (what `python -m experiments.commit_run` calls) adds them to the committed
ledger; merging is idempotent (records are matched by id), so a workdir can be merged again
after more runs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np

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


def _other_dir(ledger_dir, base_ledger_dir) -> Path | None:
    """`base_ledger_dir` unless it is None or the folder written to itself."""
    if base_ledger_dir is None:
        return None
    base = Path(base_ledger_dir).resolve()
    return None if base == Path(ledger_dir or LEDGER_DIR).resolve() else base


def _run_key(run: dict):
    return run.get("id") or (run.get("commit"), run.get("utc"))


def merge_entry(base: dict | None, delta: dict) -> dict:
    """A run ledger entry (one run name) of `base`'s records followed by `delta`'s: the
    runs of `delta` not already in `base` (by id) are appended and counted when both have
    the same defaults fingerprint; a different fingerprint in `delta` (defaults changed
    since) replaces `base`, as `record_test_scoring` restarts the count."""
    delta = json.loads(json.dumps(delta))
    if base is None or base.get("defaults_fingerprint") != delta["defaults_fingerprint"]:
        return delta
    out = json.loads(json.dumps(base))
    seen = {_run_key(r) for r in out["runs"]}
    new = [r for r in delta["runs"] if _run_key(r) not in seen]
    out["runs"] += new
    out["test_scorings"] += len(new)
    out["defaults_chosen_on"] = delta.get("defaults_chosen_on", out.get("defaults_chosen_on"))
    return out


def _write_json(path: Path, obj: dict, indent: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=indent, sort_keys=True) + "\n")
    os.replace(tmp, path)


def record_test_scoring(technique: str, run_name: str, defaults: dict, *,
                        chosen_on: str, commit: str | None = None,
                        ledger_dir: Path | str | None = None,
                        base_ledger_dir: Path | str | None = None,
                        run_id: str | None = None) -> dict:
    """Count one scoring of `run_name`'s test split with `defaults`; returns the protocol
    block for results.json. The count restarts at 1 when the defaults' fingerprint differs
    from the one recorded for this split. The run is written to `ledger_dir`; the count
    also holds `base_ledger_dir`'s records (the committed ledger, when `ledger_dir` is a
    workdir's: `merge_entry`). `run_id` names the record (the item ledger's scoring id)."""
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
    entry["runs"].append({"commit": commit, "id": run_id or uuid.uuid4().hex,
                          "utc": _now()})
    ledger["splits"][run_name] = entry
    _write_json(ledger_path(technique, ledger_dir), ledger, indent=2)
    base = _other_dir(ledger_dir, base_ledger_dir)
    if base is not None:
        entry = merge_entry(read_ledger(technique, base)["splits"].get(run_name), entry)
    return {"technique": technique, "split": "test", "run_name": run_name,
            "defaults": entry["defaults"], "defaults_fingerprint": fp,
            "defaults_chosen_on": chosen_on, "test_scorings": entry["test_scorings"]}


COMMITTED_BASE = "results/ledger"  # results.json["protocol"]["ledger_base"] of a run
# whose counts read this checkout's committed ledger (LEDGER_DIR)


def ledger_base_label(base_ledger_dir: Path | str | None) -> str | None:
    """What results.json["protocol"]["ledger_base"] records of the ledger a run's counts
    read beside its workdir's: COMMITTED_BASE for the committed ledger (LEDGER_DIR, so the
    label is the same on any machine), another folder's absolute path, None for none
    (`--ledger_base=none`). `experiments.commit_run` refuses a test run whose counts did
    not read the committed ledger it is committed to."""
    if base_ledger_dir is None:
        return None
    base = Path(base_ledger_dir).resolve()
    return COMMITTED_BASE if base == LEDGER_DIR.resolve() else str(base)


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
                   ledger_dir: Path | str | None = None,
                   base_ledger_dir: Path | str | None = None,
                   run_id: str | None = None) -> dict:
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
                               ledger_dir=ledger_dir, base_ledger_dir=base_ledger_dir,
                               run_id=run_id)


# -- the item ledger: every scored test item, whatever the run's name or fingerprint -------
#
# The run ledger above counts a run name's scorings; it cannot see the same test window
# scored under another name (specscale_small's problems inside specscale_full's, one
# PatchKV window inside another run's), and it is written after the run returns. The item
# ledger records every test item a run is about to score, by content hash, BEFORE scoring
# starts ("started"), and marks the record "completed" after: an aborted run still counts.
#
# Items: a text window is identified by the sha256 of its token ids, and carries the hashes
# of its content-defined chunks (anchored on token trigrams, as in rsync/LBFS), so a window
# that overlaps another one (inside it, shifted, or tokenized from another document that
# holds the same paragraphs) shares chunks with it; a problem, a prompt or any other
# discrete item by the sha256 of its canonical JSON. A new item was "scored before" by each
# earlier record (any technique, any run name) holding an item with its hash or one of its
# chunks; `declare_test_items` returns those counts per item.

ITEM_LEDGER_PREFIX = "items_"  # results/ledger/items_<technique>.json
CHUNK_ANCHOR = 32  # a token is a chunk boundary when its trigram hash is 0 mod this
CHUNK_MIN = 8  # tokens: chunks shorter than this are not recorded (too common to match on)
_MIX = np.uint64(0x9E3779B97F4A7C15)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def canonical(content: Any) -> str:
    """Canonical JSON of a discrete item's content (tuples as lists, sorted keys)."""
    return json.dumps(_plain(content), sort_keys=True, separators=(",", ":"))


def _ids_hash(ids: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(ids, "<i4").tobytes()).hexdigest()


def chunks(ids) -> tuple[str, ...]:
    """Content-defined chunk hashes (16 hex digits each) of token ids: a boundary follows
    each token whose trigram (with the two before it) hashes to 0 mod CHUNK_ANCHOR, at
    least CHUNK_MIN tokens after the previous boundary; chunks shorter than CHUNK_MIN (the
    tail) are dropped. Equal text gives equal chunks wherever it sits in a window."""
    ids = np.asarray(ids, np.int64).astype(np.uint64)
    n = len(ids)
    if n < CHUNK_MIN:
        return ()
    h = np.zeros(n, np.uint64)
    with np.errstate(over="ignore"):
        h[2:] = ((ids[:-2] * _MIX + ids[1:-1]) * _MIX + ids[2:]) * _MIX
    anchors = np.nonzero((h >> np.uint64(40)) % np.uint64(CHUNK_ANCHOR) == 0)[0]
    out, begin = [], 0
    for a in anchors[anchors >= 2]:
        end = int(a) + 1
        if end - begin >= CHUNK_MIN:
            out.append(_ids_hash(ids[begin:end].astype(np.int64))[:16])
            begin = end
    if n - begin >= CHUNK_MIN:
        out.append(_ids_hash(ids[begin:].astype(np.int64))[:16])
    return tuple(dict.fromkeys(out))


@dataclasses.dataclass(frozen=True)
class Item:
    """One scored test item: `key` = sha256 of its content, `kind` (window, problem,
    prompt, context, run), `what` a short human description, `chunks` (text only)."""

    kind: str
    key: str
    what: str
    chunks: tuple[str, ...] = ()

    def to_json(self) -> dict:
        out = {"kind": self.kind, "what": self.what}
        if self.chunks:
            out["chunks"] = list(self.chunks)
        return out

    @classmethod
    def from_json(cls, key: str, entry: dict) -> Item:
        """The item an item ledger lists as `key`: `entry` (its `to_json`)."""
        return cls(entry["kind"], key, entry["what"], tuple(entry.get("chunks", ())))


def window_item(ids, what: str, kind: str = "window", overlap_ids=None) -> Item:
    """A text window (token ids) as an item: keyed by the sha256 of its ids, chunked for
    overlap (`overlap_ids`: the part whose overlap counts, e.g. without a fixed template
    prefix; the whole window by default)."""
    ids = np.asarray(ids, np.int64)
    if ids.ndim != 1 or not len(ids):
        raise ValueError(f"{what}: a window is a non-empty 1-D array of token ids")
    return Item(kind, _ids_hash(ids), what,
                chunks(ids if overlap_ids is None else overlap_ids))


def text_windows(ids, spans, doc: str, kind: str = "window") -> list[Item]:
    """Items of the token ranges `spans` ([begin, end) each) of `ids` (a document named
    `doc`, e.g. "pydoc test half")."""
    ids = np.asarray(ids)
    out = []
    for b, e in spans:
        if not 0 <= b < e <= len(ids):
            raise ValueError(f"{doc}: window [{b}, {e}) is outside its {len(ids)} tokens")
        out.append(window_item(ids[b:e], f"{doc} tokens [{b}, {e}) of {len(ids)}", kind))
    return out


def tiled_windows(ids, window: int, doc: str, kind: str = "window") -> list[Item]:
    """The whole of `ids` as consecutive windows of `window` tokens (the last may be
    shorter): what a run declares when it cannot list exactly what it scores."""
    n = len(ids)
    return text_windows(ids, [(b, min(b + window, n)) for b in range(0, n, window)], doc,
                        kind)


def content_item(kind: str, content: Any, what: str | None = None) -> Item:
    """A discrete item (problem, prompt) keyed by the sha256 of its canonical JSON."""
    text = canonical(content)
    return Item(kind, sha(f"{kind}\x00{text}"), what or text[:120])


# config keys that name or place a run without changing what it scores: left out of
# `config_fingerprint`, so renaming a run does not make its run item new
COSMETIC_CONFIG_KEYS = ("run_name", "out_dir", "workdir")


def config_fingerprint(config) -> str:
    """sha256 (16 hex digits) of the run's config without its cosmetic keys (run_name,
    out_dir, workdir): equal for the same run under another name."""
    plain = _plain(config)
    if not isinstance(plain, dict):
        raise TypeError(f"a config is a dict or ConfigDict, got {type(config).__name__}")
    return fingerprint({k: v for k, v in plain.items() if k not in COSMETIC_CONFIG_KEYS})


def _name_item_key(technique: str, run_name: str) -> str:
    """The key the run item had when it was keyed by run name (records made before
    issue 45): kept as an alias so those records still count."""
    return content_item("run", [technique, run_name]).key


def run_item(technique: str, config) -> Item:
    """The fallback item of a module that does not list its test items, keyed by the
    config's fingerprint (`config_fingerprint`), so a rerun of the same config under any
    name is counted. Its `chunks` are aliases matched against recorded items' keys and
    chunks (`prior_counts`): the fingerprint key and the run-name key that earlier records
    (keyed by name) hold, so a rerun under the same name counts them too. A str `config`
    (a bare run name) gives the run-name item alone, as recorded before issue 45."""
    if isinstance(config, str):
        return Item("run", _name_item_key(technique, config),
                    f"{technique}/{config}: items not listed (module has no test_items)")
    fp = config_fingerprint(config)
    key = content_item("run", [technique, {"config_fingerprint": fp}]).key
    return Item("run", key, f"{technique}/{config.get('run_name')} (config {fp}): items not "
                "listed (module has no test_items)",
                (key, _name_item_key(technique, config.get("run_name", ""))))


def item_ledger_path(technique: str, ledger_dir: Path | str | None = None) -> Path:
    ledger_path(technique)  # validates the name
    return Path(ledger_dir or LEDGER_DIR) / f"{ITEM_LEDGER_PREFIX}{technique}.json"


def _empty_item_ledger(technique: str) -> dict:
    return {"technique": technique, "items": {}, "scorings": []}


def read_item_ledger(technique: str, ledger_dir: Path | str | None = None) -> dict:
    path = item_ledger_path(technique, ledger_dir)
    if not path.exists():
        return _empty_item_ledger(technique)
    try:
        ledger = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"item ledger {path} is not valid JSON ({e}); fix it") from None
    if ledger.get("technique") != technique or not isinstance(ledger.get("scorings"), list):
        raise ValueError(f"{path} is not an item ledger of {technique!r}")
    return ledger


def merge_item_ledger(base: dict, delta: dict) -> dict:
    """`base`'s items and records plus `delta`'s (one technique): a record of `delta` with
    an id already in `base` replaces it (a "started" record completed since), the others
    are appended."""
    out = json.loads(json.dumps(base))
    for key, item in delta["items"].items():
        out["items"].setdefault(key, item)
    index = {r["id"]: i for i, r in enumerate(out["scorings"])}
    for rec in delta["scorings"]:
        if rec["id"] in index:
            out["scorings"][index[rec["id"]]] = rec
        else:
            out["scorings"].append(rec)
    return out


def item_ledgers(ledger_dir: Path | str | None = None,
                 base_ledger_dir: Path | str | None = None) -> list[dict]:
    """Every technique's item ledger in `ledger_dir` (with `base_ledger_dir`'s records
    merged in first when given: `merge_item_ledger`)."""
    d = Path(ledger_dir or LEDGER_DIR)
    dirs = [b for b in (_other_dir(d, base_ledger_dir),) if b is not None] + [d]
    out: dict[str, dict] = {}
    for folder in dirs:
        for p in sorted(folder.glob(f"{ITEM_LEDGER_PREFIX}*.json")):
            technique = p.stem[len(ITEM_LEDGER_PREFIX):]
            ledger = read_item_ledger(technique, folder)
            out[technique] = (merge_item_ledger(out[technique], ledger)
                              if technique in out else ledger)
    return [out[t] for t in sorted(out)]


@contextlib.contextmanager
def _locked(ledger_dir: Path | str | None):
    d = Path(ledger_dir or LEDGER_DIR)
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".items.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_item_ledger(ledger: dict, ledger_dir) -> None:
    path = item_ledger_path(ledger["technique"], ledger_dir)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(ledger, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


SCORED, LOAD = "scored", "load"  # a record's use of its items (module TEST_ITEMS_USE)


def prior_counts(items: list[Item], ledger_dir: Path | str | None = None,
                 exclude: str | None = None, use: str = SCORED,
                 base_ledger_dir: Path | str | None = None,
                 before: str | None = None,
                 run_times: dict[str, list[str]] | None = None) -> list[dict]:
    """Per item {"prior": n, "by_technique": {technique: n}}: how many earlier records of
    `use` hold the item or an item overlapping it (a shared chunk), in every technique's
    item ledger. "scored": runs that measured quality or accuracy on the item; "load":
    runs that used it only as a workload (serving speed, routing traces), counted apart so
    a throughput run does not mark every quality number re-scored. A record's `count`
    (default 1) is the number of scorings it stands for (seeded history). `exclude`: a
    scoring id to skip. `base_ledger_dir`: the committed ledger, read with a workdir's.
    `before` (UTC, "%Y-%m-%dT%H:%M:%SZ"): count only the scorings made before then
    (`scoring_times`), to back-fill a run older than the item ledger; `run_times`: the
    run ledgers' times (`run_ledger_times`), read from `ledger_dir` when not given."""
    times = {} if before is None else (run_ledger_times(ledger_dir) if run_times is None
                                       else run_times)
    by_key: dict[str, list] = {}
    by_chunk: dict[str, list] = {}
    for ledger in item_ledgers(ledger_dir, base_ledger_dir):
        t = ledger["technique"]
        for rec in ledger["scorings"]:
            if (rec.get("id") == exclude or not rec.get("items")
                    or rec.get("use", SCORED) != use):
                continue
            n = (int(rec.get("count", 1)) if before is None else
                 sum(u < before for u in scoring_times(rec, times)))
            if not n:
                continue
            ref = (t, rec["id"], n)
            for key in rec["items"]:
                by_key.setdefault(key, []).append(ref)
                for c in ledger["items"].get(key, {}).get("chunks", ()):
                    by_chunk.setdefault(c, []).append(ref)
    out = []
    for item in items:
        refs = {r for r in by_key.get(item.key, ())}
        for c in item.chunks:  # a chunk equal to a recorded key: a run item's alias
            refs.update(by_chunk.get(c, ()))
            refs.update(by_key.get(c, ()))
        per: dict[str, int] = {}
        for t, _, n in refs:
            per[t] = per.get(t, 0) + n
        out.append({"prior": sum(per.values()), "by_technique": per})
    return out


@dataclasses.dataclass
class Declaration:
    """What `declare_test_items` wrote: the record's id and each item's prior counts."""

    technique: str
    run_name: str
    scoring_id: str
    items: list[Item]
    prior: list[int]  # per item: earlier scorings of it (or of an overlapping item), anywhere
    prior_same_technique: list[int]
    unlisted_prior: list[dict]  # the technique's documented scorings without item lists
    prior_by_technique: list[dict] = dataclasses.field(default_factory=list)
    prior_load: list[int] = dataclasses.field(default_factory=list)  # earlier "load" uses
    use: str = SCORED

    def block(self, status: str = "started") -> dict:
        """The results.json["protocol"]["items"] block."""
        rescored = [p for p in self.prior if p > 0]
        same = [p for p in self.prior_same_technique if p > 0]
        return {"scoring_id": self.scoring_id, "status": status, "use": self.use,
                "items_total": len(self.items), "items_rescored": len(rescored),
                "max_prior_load_uses": max(self.prior_load, default=0),
                "max_prior_scorings": max(self.prior, default=0),
                "items_rescored_same_technique": len(same),
                "max_prior_scorings_same_technique": max(self.prior_same_technique,
                                                         default=0),
                "kinds": sorted({i.kind for i in self.items}),
                # per technique that scored some of these items before: the most times
                "max_prior_by_technique": {
                    t: max(p.get(t, 0) for p in self.prior_by_technique)
                    for t in sorted({t for p in self.prior_by_technique for t in p})},
                "unlisted_prior_scorings": [
                    {k: u[k] for k in ("count", "reason") if k in u}
                    for u in self.unlisted_prior]}


def declare_test_items(technique: str, run_name: str, items: list[Item], *,
                       defaults_fingerprint: str | None = None, commit: str | None = None,
                       ledger_dir: Path | str | None = None,
                       use: str = SCORED,
                       base_ledger_dir: Path | str | None = None) -> Declaration:
    """Record that `run_name` of `technique` is about to score `items` (status "started",
    written now, before any scoring) and return, per item, how many times it (or an item
    overlapping it) was scored before anywhere. Call `complete_test_items` after.
    use: SCORED (quality/accuracy is measured on the items) or LOAD (`prior_counts`).
    The record goes to `ledger_dir`; prior counts also read `base_ledger_dir` (read only)."""
    if not items:
        raise ValueError(f"{technique}/{run_name}: a test run must declare its test items")
    if use not in (SCORED, LOAD):
        raise ValueError(f"use must be {SCORED!r} or {LOAD!r}, got {use!r}")
    items = list({i.key: i for i in items}.values())  # one per content
    with _locked(ledger_dir):
        counts = prior_counts(items, ledger_dir, base_ledger_dir=base_ledger_dir)
        load = prior_counts(items, ledger_dir, use=LOAD, base_ledger_dir=base_ledger_dir)
        ledger = read_item_ledger(technique, ledger_dir)
        base = _other_dir(ledger_dir, base_ledger_dir)
        history = (merge_item_ledger(read_item_ledger(technique, base), ledger)
                   if base is not None else ledger)
        for i in items:
            ledger["items"].setdefault(i.key, i.to_json())
        sid = f"{_now()}-{uuid.uuid4().hex[:8]}"
        ledger["scorings"].append({
            "id": sid, "run_name": run_name, "status": "started", "started_utc": _now(),
            "completed_utc": None, "defaults_fingerprint": defaults_fingerprint,
            "commit": commit, "use": use, "items": [i.key for i in items]})
        _write_item_ledger(ledger, ledger_dir)
    unlisted = [r for r in history["scorings"] if not r.get("items")]
    return Declaration(technique, run_name, sid, items, [c["prior"] for c in counts],
                       [c["by_technique"].get(technique, 0) for c in counts], unlisted,
                       [c["by_technique"] for c in counts], [c["prior"] for c in load], use)


def complete_test_items(declaration: Declaration,
                        ledger_dir: Path | str | None = None) -> None:
    """Mark `declaration`'s record "completed" (a record left "started" is an aborted run;
    it is counted all the same)."""
    with _locked(ledger_dir):
        ledger = read_item_ledger(declaration.technique, ledger_dir)
        for rec in ledger["scorings"]:
            if rec["id"] == declaration.scoring_id:
                rec["status"], rec["completed_utc"] = "completed", _now()
                break
        else:
            raise ValueError(f"no scoring {declaration.scoring_id} in the item ledger of "
                             f"{declaration.technique}")
        _write_item_ledger(ledger, ledger_dir)


def record_prior_scorings(technique: str, label: str, items: list[Item] | None, *,
                          count: int, reason: str, ledger_dir: Path | str | None = None,
                          use: str = SCORED, scorings_of: str | None = None,
                          scored_utc: list[str] | None = None) -> None:
    """Seed the item ledger with `count` scorings that happened before it existed: with
    their items when they can be rebuilt, else (items None) a documented entry that the
    technique's runs report as unlisted prior scorings. `scorings_of`: the run (a run
    ledger name) whose scorings these are, the last one being its run ledger's record;
    `scored_utc`: the time of each of the `count` scorings where known (`scoring_times`).
    Idempotent per `label`."""
    if scored_utc is not None and len(scored_utc) != count:
        raise ValueError(f"{label}: scored_utc needs one time per scoring ({count}), got "
                         f"{len(scored_utc)}")
    if count < 1 or not reason:
        raise ValueError("a prior scoring needs count >= 1 and a reason")
    with _locked(ledger_dir):
        ledger = read_item_ledger(technique, ledger_dir)
        ledger["scorings"] = [r for r in ledger["scorings"] if r["id"] != f"prior:{label}"]
        for i in items or ():
            ledger["items"].setdefault(i.key, i.to_json())
        ledger["scorings"].append({
            "id": f"prior:{label}", "run_name": label, "status": "prior", "count": count,
            "reason": reason, "use": use, "items": [i.key for i in items] if items else [],
            **({"scorings_of": scorings_of} if scorings_of else {}),
            **({"scored_utc": list(scored_utc)} if scored_utc else {})})
        _write_item_ledger(ledger, ledger_dir)


def list_test_items(module, config) -> list[Item]:
    """`module.test_items(config)` (the items the run will score), or the run-name
    fallback item for a module that cannot list them."""
    fn = getattr(module, "test_items", None)
    items = list(fn(config)) if fn is not None else [run_item(module.TECHNIQUE, config)]
    if not items or not all(isinstance(i, Item) for i in items):
        raise ValueError(f"{module.__name__}.test_items must return a non-empty list of "
                         "protocol.Item")
    return items


def rescored_line(items_block: dict | None) -> str:
    """The table.md line stating the run's re-scored test items."""
    if not items_block:
        return "protocol: dev run, no test item scored"
    n, r, k = (items_block[x] for x in ("items_total", "items_rescored",
                                        "max_prior_scorings"))
    line = (f"protocol: {n} test item(s) ({', '.join(items_block['kinds'])}); "
            + (f"{r} re-scored (up to {k} earlier scoring(s) anywhere: every number above is "
               f"re-scored ({k}))" if r else "none scored before (item ledger)"))
    same = items_block["items_rescored_same_technique"]
    if same:
        line += (f"; {same} by this technique (up to "
                 f"{items_block['max_prior_scorings_same_technique']})")
    by = items_block.get("max_prior_by_technique") or {}
    if by:
        line += "; earlier scorings by technique: " + ", ".join(f"{t} {n}"
                                                              for t, n in by.items())
    for u in items_block["unlisted_prior_scorings"]:
        line += f"; unlisted prior scorings of this technique: {u['count']} ({u['reason']})"
    if items_block.get("max_prior_load_uses"):
        line += (f"; used as a workload (no quality scored) by up to "
                 f"{items_block['max_prior_load_uses']} earlier run(s)")
    if items_block.get("use") == LOAD:
        line += "; this run uses its items as a workload only (speed, not quality)"
    return line


def begin_test_run(module, config, *, commit: str | None = None,
                   ledger_dir: Path | str | None = None,
                   base_ledger_dir: Path | str | None = None) -> Declaration | None:
    """Before a test run scores anything: list its items and declare them (None for a dev
    run). Called by `experiments.run`; the record stays "started" if the run aborts."""
    if validate(module, config) != "test":
        return None
    return declare_test_items(module.TECHNIQUE, config.run_name,
                              list_test_items(module, config),
                              defaults_fingerprint=fingerprint(module.defaults(config)),
                              commit=commit, ledger_dir=ledger_dir,
                              use=getattr(module, "TEST_ITEMS_USE", SCORED),
                              base_ledger_dir=base_ledger_dir)


def annotate_report(report, items_block: dict | None) -> None:
    """Put the re-scored count beside the run's numbers: each claim's measured value gets
    " re-scored (k)" (k = the most earlier scorings of any of the run's test items) and the
    notes (table.md) get `rescored_line`."""
    if items_block and items_block["max_prior_scorings"]:
        k = items_block["max_prior_scorings"]
        for c in report.claims:
            m = c.get("measured")
            m = f"{m:.4g}" if isinstance(m, float) else str(m)
            c["measured"] = f"{m} re-scored ({k})"
    report.notes.append(rescored_line(items_block))


def overlaps(a: list[Item], b: list[Item]) -> list[tuple[Item, Item]]:
    """The pairs (x in a, y in b) that are the same item or share a chunk of text: what a
    dev or calibration item must never have with a test item."""
    by_key = {y.key: y for y in b}
    by_chunk = {c: y for y in b for c in y.chunks}
    out = []
    for x in a:
        y = by_key.get(x.key) or next((by_chunk[c] for c in x.chunks if c in by_chunk), None)
        if y is not None:
            out.append((x, y))
    return out


# -- committing a workdir's ledger records -----------------------------------------------

def merge_ledgers(src_dir: Path | str, dst_dir: Path | str | None = None) -> list[str]:
    """Add every record of the ledgers in `src_dir` (a workdir's `ledger/`) to those in
    `dst_dir` (the committed results/ledger/ by default): run ledgers by `merge_entry`,
    item ledgers by `merge_item_ledger`. Every record goes, whatever run it belongs to (an
    aborted or uncommitted run's scorings count all the same); records already merged are
    matched by id, so merging again adds nothing. Returns a log of what changed."""
    src, dst = Path(src_dir), Path(dst_dir or LEDGER_DIR)
    if _other_dir(dst, src) is None:
        return []
    log = []
    with _locked(dst):
        for path in sorted(src.glob("*.json")):
            if path.name.startswith(ITEM_LEDGER_PREFIX):
                technique = path.stem[len(ITEM_LEDGER_PREFIX):]
                old = read_item_ledger(technique, dst)
                new = merge_item_ledger(old, read_item_ledger(technique, src))
                if new != old:
                    _write_item_ledger(new, dst)
                    log.append(f"{item_ledger_path(technique, dst)}: "
                               f"{len(new['scorings']) - len(old['scorings'])} new record(s), "
                               f"{len(new['items']) - len(old['items'])} new item(s)")
                continue
            technique = path.stem
            old = read_ledger(technique, dst)
            new = json.loads(json.dumps(old))
            for run_name, entry in read_ledger(technique, src)["splits"].items():
                new["splits"][run_name] = merge_entry(old["splits"].get(run_name), entry)
            if new != old:
                _write_json(ledger_path(technique, dst), new, indent=2)
                for run_name, entry in new["splits"].items():
                    before = old["splits"].get(run_name) or {}
                    if entry != before:
                        log.append(f"{ledger_path(technique, dst)}: {run_name} test_scorings "
                                   f"{before.get('test_scorings', 0)} -> "
                                   f"{entry['test_scorings']} (defaults "
                                   f"{entry['defaults_fingerprint']})")
    return log


# -- seeding the item ledger with what was scored before it existed ------------------------

RUN_LEDGER_LABEL = "run-ledger:"  # seeded records of a run ledger's run: "prior:run-ledger:<run>"


def run_ledger_times(ledger_dir: Path | str | None = None) -> dict[str, list[str]]:
    """Run name -> the UTC time of each of its test scorings in the run ledgers."""
    out: dict[str, list[str]] = {}
    for path in sorted(Path(ledger_dir or LEDGER_DIR).glob("*.json")):
        if not path.name.startswith(ITEM_LEDGER_PREFIX):
            for run_name, entry in read_ledger(path.stem, path.parent)["splits"].items():
                out[run_name] = [r.get("utc") or "" for r in entry.get("runs", [])]
    return out


def scoring_times(rec: dict, run_times: dict[str, list[str]]) -> list[str]:
    """The UTC time of each scoring an item-ledger record stands for ("" = before the
    dev/test protocol, so before any run): a live record its start; a seeded run-ledger
    record its run's run-ledger times; a known leak of a run's own scorings (`scorings_of`)
    that run's times, the rest of its count before them (unless it lists `scored_utc`,
    their times); any other seeded leak "" each."""
    count = int(rec.get("count", 1))
    if rec.get("started_utc"):
        return [rec["started_utc"]] * count
    if rec.get("scored_utc"):  # a leak whose scorings' times are known
        return list(rec["scored_utc"])
    run = record_run(rec)
    known = run_times.get(run, [])[-count:] if run else []
    return [""] * (count - len(known)) + known


def record_run(rec: dict) -> str | None:
    """The run whose scorings a seeded item-ledger record stands for (a run-ledger record,
    or a known leak of a run's own scorings, `scorings_of`); None for any other record."""
    name = rec.get("run_name", "")
    return rec.get("scorings_of") or (name.removeprefix(RUN_LEDGER_LABEL)
                                      if name.startswith(RUN_LEDGER_LABEL) else None)


def _run_ledger_reason(technique: str, run_name: str, entry: dict) -> str:
    commits = sorted({(r.get("commit") or "?")[:7] for r in entry.get("runs", [])})
    return (f"run ledger results/ledger/{technique}.json: {run_name} scored "
            f"{entry['test_scorings']} time(s) with defaults {entry['defaults_fingerprint']} "
            f"(commit(s) {', '.join(commits)}); items rebuilt from "
            f"results/{run_name}/results.json's config")


def heldout_windows(spans, doc="pydoc heldout (dev + test topics)") -> list[Item]:
    """Windows of the whole held-out prose (dev and test topics, the text the runs before
    the dev/test halves scored) with the embedded tokenizer: for `prior_scorings`."""
    from experiments import common
    from research import data
    ids = common.tokenizer_only(None).encode(data.corpus_text("heldout"))
    return text_windows(ids, spans, doc)


def _experiment_modules() -> list:
    """Every experiments/<x>/experiment.py, imported by name (so this module imports no
    experiment statically)."""
    import importlib
    root = Path(__file__).resolve().parent
    return [importlib.import_module(f"experiments.{p.parent.name}.experiment")
            for p in sorted(root.glob("*/experiment.py"))]


# runs whose items the run ledger cannot rebuild from today's code (their split changed):
# the experiment's `prior_scorings()` entries stand for them
_REBUILT_BY_LEAKS = {("dynacore", "dynacore_small"), ("dynacore", "dynacore_full")}


def seed_history(ledger_dir: Path | str | None = None,
                 results_dir: Path | str | None = None) -> list[str]:
    """Seed the item ledgers from the run ledgers (results/ledger/<technique>.json: each
    test run's items rebuilt from its results.json config by its module's `test_items`)
    and from each experiment module's `prior_scorings()` (issue 36's list of leaks: dicts
    of label, count, reason and items, None when they cannot be rebuilt); a run whose items
    cannot be rebuilt gets a documented entry without items. Idempotent (entries are
    replaced by label). Returns a log."""
    import importlib

    from ml_collections import ConfigDict
    ledger_dir = Path(ledger_dir or LEDGER_DIR)
    results_dir = Path(results_dir or ledger_dir.parent)
    log = []
    live = {r["run_name"] for led in item_ledgers(ledger_dir) for r in led["scorings"]
            if r.get("started_utc")}  # runs the item ledger recorded as they ran
    for path in sorted(ledger_dir.glob("*.json")):
        if path.name.startswith(ITEM_LEDGER_PREFIX):
            continue
        technique = path.stem
        for run_name, entry in read_ledger(technique, ledger_dir)["splits"].items():
            if ((technique, run_name) in _REBUILT_BY_LEAKS or run_name in live
                    or any(r.get("id") for r in entry.get("runs", []))):
                continue  # a leak entry stands for it, or the item ledger recorded it live
            label, reason = RUN_LEDGER_LABEL + run_name, _run_ledger_reason(technique, run_name,
                                                                          entry)
            items, use = None, SCORED
            try:
                payload = json.loads((results_dir / run_name / "results.json").read_text())
                config = ConfigDict(payload["config"])
                module = importlib.import_module(config.experiment)
                items = list_test_items(module, config)
                use = getattr(module, "TEST_ITEMS_USE", SCORED)
            except Exception as e:  # noqa: BLE001 - recorded as an unlisted entry instead
                reason += f"; items not rebuilt ({type(e).__name__}: {str(e)[:160]})"
            record_prior_scorings(technique, label, items, count=entry["test_scorings"],
                                  reason=reason, ledger_dir=ledger_dir, use=use)
            log.append(f"{technique}/{label}: {len(items) if items else 'unlisted'} items x "
                       f"{entry['test_scorings']}")
    for module in _experiment_modules():  # the leaks each experiment knows of (issue 36)
        for p in getattr(module, "prior_scorings", lambda: [])():
            record_prior_scorings(module.TECHNIQUE, p["label"], p["items"], count=p["count"],
                                  reason=p["reason"], ledger_dir=ledger_dir,
                                  scorings_of=p.get("scorings_of"),
                                  scored_utc=p.get("scored_utc"))
            log.append(f"{module.TECHNIQUE}/{p['label']}: "
                       f"{len(p['items']) if p['items'] else 'unlisted'} items x {p['count']}")
    return log


if __name__ == "__main__":
    import sys
    if sys.argv[1:] != ["seed"]:
        sys.exit("usage: python -m experiments.protocol seed   (seed results/ledger/items_*.json"
                 " from the run ledgers and issue 36's list of leaks)")
    from experiments import protocol  # the module the experiments import, not __main__
    print("\n".join(protocol.seed_history()))
