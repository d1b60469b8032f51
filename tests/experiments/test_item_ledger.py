"""The item ledger (experiments/protocol.py): every scored test item, whatever the run's
name or fingerprint, written before scoring and completed after."""
import json
import types

import numpy as np
import pytest
from ml_collections import ConfigDict

from experiments import common, protocol


def _text(n=3000, seed=0):
    """Token ids of a fake document: random, so chunks are distinct."""
    return np.random.default_rng(seed).integers(0, 49152, n)


def test_an_overlapping_window_under_another_run_name_is_counted(tmp_path):
    ids = _text()
    big = protocol.text_windows(ids, [(0, 1024)], "doc")  # e.g. patchkv_4k_test's window
    protocol.complete_test_items(
        protocol.declare_test_items("patchkv", "patchkv_4k_test", big, ledger_dir=tmp_path),
        ledger_dir=tmp_path)
    # another run name, a window inside the first one (patchkv_small_test's), one shifted
    # half out of it, and one elsewhere
    small = protocol.text_windows(ids, [(100, 612), (800, 1300), (2000, 2512)], "doc")
    d = protocol.declare_test_items("patchkv", "patchkv_small_test", small,
                                    ledger_dir=tmp_path)
    assert d.prior == [1, 1, 0]
    assert d.prior_same_technique == [1, 1, 0]
    b = d.block()
    assert (b["items_total"], b["items_rescored"], b["max_prior_scorings"]) == (3, 2, 1)
    # the same text tokenized into another document at another offset: still caught
    moved = np.concatenate([_text(77, seed=5), ids[300:700]])
    other = protocol.declare_test_items("baseline", "baseline_small",
                                        protocol.text_windows(moved, [(0, 477)], "doc2"),
                                        ledger_dir=tmp_path)
    assert other.prior == [2] and other.prior_same_technique == [0]  # two records hold it


def test_workload_uses_are_recorded_apart_from_scorings(tmp_path):
    """A throughput run that uses the test text as its workload (TEST_ITEMS_USE = "load")
    is recorded and reported, but does not mark quality numbers re-scored."""
    ids = _text()
    load = protocol.tiled_windows(ids, 256, "doc")
    protocol.declare_test_items("serving", "serving_small", load, ledger_dir=tmp_path,
                                use=protocol.LOAD)
    d = protocol.declare_test_items("tasq", "tasq_small",
                                    protocol.text_windows(ids, [(0, 256)], "doc"),
                                    ledger_dir=tmp_path)
    assert d.prior == [0] and d.prior_load == [1]
    b = d.block()
    assert b["items_rescored"] == 0 and b["max_prior_load_uses"] == 1
    assert "workload" in protocol.rescored_line(b)
    again = protocol.declare_test_items("tasq", "tasq_rerun",
                                        protocol.text_windows(ids, [(0, 256)], "doc"),
                                        ledger_dir=tmp_path)
    assert again.prior == [1]  # the scored run before it counts
    with pytest.raises(ValueError, match="use must be"):
        protocol.declare_test_items("tasq", "x", load, ledger_dir=tmp_path, use="other")


def test_an_aborted_run_is_counted(tmp_path):
    items = [protocol.content_item("prompt", {"text": "Why is the sky blue?", "chat": True})]
    protocol.declare_test_items("specdecode", "specdecode_small", items,
                                ledger_dir=tmp_path)  # never completed: the run died
    ledger = json.loads((tmp_path / "items_specdecode.json").read_text())
    assert [r["status"] for r in ledger["scorings"]] == ["started"]
    again = protocol.declare_test_items("specdecode", "specdecode_full", items,
                                        ledger_dir=tmp_path)
    assert again.prior == [1]
    protocol.complete_test_items(again, ledger_dir=tmp_path)
    ledger = json.loads((tmp_path / "items_specdecode.json").read_text())
    assert [r["status"] for r in ledger["scorings"]] == ["started", "completed"]
    assert protocol.declare_test_items("specdecode", "x", items,
                                       ledger_dir=tmp_path).prior == [2]


def test_a_subset_of_problems_under_another_name_is_counted(tmp_path):
    from experiments.specscale import experiment as ss, specscale
    small, full = (specscale.get_config(a) for a in ("small", "full"))
    d_full = protocol.declare_test_items("specscale", "specscale_full", ss.test_items(full),
                                         ledger_dir=tmp_path)
    assert d_full.prior == [0] * 200
    d_small = protocol.declare_test_items("specscale", "specscale_small",
                                          ss.test_items(small), ledger_dir=tmp_path)
    assert d_small.prior == [1] * 16  # specscale_small ⊂ specscale_full


def test_prior_scorings_are_seeded_with_or_without_items(tmp_path):
    ids = _text()
    protocol.record_prior_scorings("dynacore", "old", protocol.text_windows(
        ids, [(0, 256)], "doc"), count=3, reason="old defaults", ledger_dir=tmp_path)
    protocol.record_prior_scorings("dynacore", "old", protocol.text_windows(
        ids, [(0, 256)], "doc"), count=3, reason="old defaults", ledger_dir=tmp_path)
    protocol.record_prior_scorings("dynacore", "unlisted", None, count=2,
                                   reason="items lost", ledger_dir=tmp_path)
    d = protocol.declare_test_items("dynacore", "dynacore_small",
                                    protocol.text_windows(ids, [(0, 256)], "doc"),
                                    ledger_dir=tmp_path)
    assert d.prior == [3]  # idempotent seeding: one record of count 3
    b = d.block()
    assert b["unlisted_prior_scorings"] == [{"count": 2, "reason": "items lost"}]
    line = protocol.rescored_line(b)
    assert "re-scored (3)" in line and "unlisted prior scorings" in line


def test_chunks_ignore_position_and_need_content():
    ids = _text(1000)
    a = protocol.chunks(ids[100:600])
    b = protocol.chunks(np.concatenate([[1, 2, 3], ids[100:600]]))
    assert len(set(a) & set(b)) >= len(a) - 2 >= 5  # all but the edge chunks
    assert protocol.chunks(ids[:5]) == ()
    assert not set(protocol.chunks(_text(1000, seed=1))) & set(protocol.chunks(ids))
    with pytest.raises(ValueError, match="outside"):
        protocol.text_windows(ids, [(900, 1200)], "doc")


def _module(items=None):
    m = types.SimpleNamespace(__name__="fake", TECHNIQUE="fake", DEFAULTS_CHOSEN_ON="dev",
                              defaults=lambda c: {"k": 1})
    if items is not None:
        m.test_items = lambda c: items
    return m


def test_the_runner_declares_before_and_reports_after(tmp_path):
    cfg = ConfigDict({"run_name": "fake_small", "split": "test"})
    items = [protocol.content_item("prompt", {"text": "a"})]
    for _ in range(2):
        d = protocol.begin_test_run(_module(items), cfg, ledger_dir=tmp_path)
        protocol.complete_test_items(d, ledger_dir=tmp_path)
    assert d.prior == [1]
    report = common.Report(columns=["x"], rows=[{"x": 1.0}],
                           claims=[common.claim("c", "> 0", 0.5, True)])
    protocol.annotate_report(report, d.block("completed"))
    assert report.claims[0]["measured"] == "0.5 re-scored (1)"
    assert "re-scored (1)" in common.render_markdown(report)
    # a dev run declares nothing; a module without test_items falls back to its run name
    assert protocol.begin_test_run(_module(items), ConfigDict(
        {"run_name": "fake_dev", "split": "dev"}), ledger_dir=tmp_path) is None
    fallback = protocol.begin_test_run(_module(), cfg, ledger_dir=tmp_path)
    assert [i.kind for i in fallback.items] == ["run"]
    with pytest.raises(ValueError, match="non-empty list"):
        protocol.begin_test_run(_module([]), cfg, ledger_dir=tmp_path)


EXPERIMENTS = ["baseline", "tasq", "specscale", "specdecode", "megaflux", "patchkv",
               "dynacore", "serving", "scaleout"]


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_lists_its_test_items(name):
    import importlib
    module = importlib.import_module(f"experiments.{name}.experiment")
    config = importlib.import_module(f"experiments.{name}.{name}").get_config("small")
    items = protocol.list_test_items(module, config)
    assert items and all(isinstance(i, protocol.Item) for i in items)
    assert all(i.kind != "run" for i in items)  # listed, not the run-name fallback
    assert len({i.key for i in items}) == len(items)


def test_the_committed_item_ledgers_are_valid():
    ledgers = protocol.item_ledgers()
    assert {ledger["technique"] for ledger in ledgers} >= {"tasq", "dynacore", "specscale",
                                                          "specdecode"}
    for ledger in ledgers:
        for rec in ledger["scorings"]:
            assert rec["status"] in ("prior", "started", "completed"), rec["id"]
            assert all(k in ledger["items"] for k in rec["items"]), rec["id"]
            if rec["status"] == "prior":
                assert rec["count"] >= 1 and rec["reason"]


def test_runner_end_to_end_counts_reruns_renamed_and_aborted_runs(tmp_path):
    """experiments.run on the baseline with a tiny model: the items are declared before the
    run, an aborted run stays "started" and counts, a rerun under another name reports
    re-scored (k) in results.json and table.md."""
    from tests.experiments.test_run import _run, _tiny_overrides
    import jax
    from research.model import init_params, tiny_config
    from tests.model.gguf_writer import byte_vocab, write_llama_gguf
    config = tiny_config(vocab_size=len(byte_vocab()[0]), head_dim=16)
    path = write_llama_gguf(tmp_path / "tiny.gguf", config,
                            init_params(config, jax.random.key(0)))
    text = tmp_path / "text.txt"
    text.write_text("the thin tin in the thin inn. " * 20)
    over = _tiny_overrides((path, text))
    work = tmp_path / "w"
    aborted = _run(work, *over, "--config.ppl.batch_size=0")  # fails inside run()
    assert aborted.returncode != 0
    ledger = json.loads((work / "ledger" / "items_baseline.json").read_text())
    assert [r["status"] for r in ledger["scorings"]] == ["started"]
    proc = _run(work, *over, "--config.run_name=baseline_renamed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = work / "baseline_renamed"
    items = json.loads((out / "results.json").read_text())["protocol"]["items"]
    n = items["items_total"]  # windows of a repetitive text: equal ones are one item
    assert items["status"] == "completed" and n >= 1
    assert items["items_rescored"] == n and items["max_prior_scorings"] == 1
    table = (out / "table.md").read_text()
    assert "re-scored (1)" in table and f"protocol: {n} test item(s)" in table
    ledger = json.loads((work / "ledger" / "items_baseline.json").read_text())
    assert [r["status"] for r in ledger["scorings"]] == ["started", "completed"]


def _old_run(results, ledger_dir, technique, name, utcs, claim_value=2.0):
    """A run made before the item ledger: its run-ledger entry and results folder."""
    path = ledger_dir / f"{technique}.json"
    ledger = json.loads(path.read_text()) if path.exists() else {"technique": technique,
                                                                  "splits": {}}
    ledger["splits"][name] = {"defaults_fingerprint": "f", "test_scorings": len(utcs),
                              "runs": [{"commit": "c", "utc": u} for u in utcs]}
    path.write_text(json.dumps(ledger))
    report = common.Report(columns=["x"], rows=[{"x": 1.0}],
                           claims=[common.claim("speed", "> 1x", claim_value, True)])
    common.write_results(report, results / name, {"run_name": name}, 0, ["cmd"], 1.0,
                         git={}, protocol={"technique": technique, "split": "test",
                                           "run_name": name, "test_scorings": len(utcs)})


def test_backfill_counts_only_the_scorings_made_before_the_run(tmp_path):
    from experiments import backfill_items
    ledger_dir, results = tmp_path / "ledger", tmp_path / "results"
    ledger_dir.mkdir()
    ids = _text()
    first = protocol.text_windows(ids, [(0, 1024)], "doc")
    inside = protocol.text_windows(ids, [(100, 612)], "doc")  # inside `first`
    _old_run(results, ledger_dir, "tasq", "old_a", ["2026-01-01T00:00:00Z"])
    protocol.record_prior_scorings("tasq", protocol.RUN_LEDGER_LABEL + "old_a", first,
                                   count=1, reason="run ledger", ledger_dir=ledger_dir)
    # old_b: two scorings, the first before old_a (a leak with its times), the last its own
    _old_run(results, ledger_dir, "baseline", "old_b", ["2026-01-02T00:00:00Z"])
    protocol.record_prior_scorings(
        "baseline", "leak:old_b", inside, count=2, reason="scored twice",
        ledger_dir=ledger_dir, scorings_of="old_b",
        scored_utc=["2025-12-31T00:00:00Z", "2026-01-02T00:00:00Z"])
    protocol.declare_test_items("tasq", "later", first, ledger_dir=ledger_dir)  # live, now
    assert "1 re-scored" in backfill_items.backfill(results / "old_a", ledger_dir)
    assert "re-scored (2)" in backfill_items.backfill(results / "old_b", ledger_dir)
    payload = json.loads((results / "old_b" / "results.json").read_text())
    block = payload["protocol"]["items"]
    assert (block["max_prior_scorings"], block["max_prior_by_technique"]) == (
        2, {"baseline": 1, "tasq": 1})  # its own earlier scoring and old_a; not "later"
    assert "before 2026-01-02T00:00:00Z" in block["backfilled"]
    assert payload["claims"][0]["measured"] == "2 re-scored (2)"
    table = (results / "old_b" / "table.md").read_text()
    assert "| speed | > 1x | 2 re-scored (2) | yes |" in table
    assert "protocol: 1 test item(s)" in table
    old_a = json.loads((results / "old_a" / "results.json").read_text())
    assert old_a["protocol"]["items"]["max_prior_scorings"] == 1  # old_b's first scoring
    assert "already" in backfill_items.backfill(results / "old_b", ledger_dir)  # idempotent
    with pytest.raises(ValueError, match="one time per scoring"):
        protocol.record_prior_scorings("tasq", "x", first, count=2, reason="r",
                                       ledger_dir=ledger_dir, scored_utc=["2026"])


def test_a_speed_only_long_context_run_declares_its_run_item():
    """quality.windows 0 scores no text: the run still declares an item (its name), so it
    can run (a test run must declare items) and its reruns are counted."""
    from experiments.serving import long_context, long_context_experiment as L
    config = long_context.get_config("small")
    config.quality.windows = 0
    items = protocol.list_test_items(L, config)
    assert [(i.kind, i.key) for i in items] == [
        ("run", protocol.run_item("serving", config).key)]
