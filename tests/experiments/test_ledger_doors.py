"""A ledger with no side doors (issue 45): every path that scores a test-split item records
it. One test per door: the lm-eval harness (per paragraph, honouring config.split),
`commit_run` (refuses a run whose counts did not read the committed ledger), the run item
(keyed by the config's fingerprint, not the run name), notebooks and tests (dev or
calibration text only)."""
import ast
import json
import re
from pathlib import Path

import pytest
from ml_collections import ConfigDict

from experiments import commit_run, common, protocol

ROOT = Path(__file__).resolve().parents[2]


# -- the harness ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def harness_docs():
    from experiments.serving import harness_experiment as H
    tok = common.tokenizer_only(None)
    return {s: H.corpus_docs(tok, 512, 0, s) for s in ("dev", "test")}


def test_the_harness_reads_the_half_its_split_names(harness_docs, tmp_path):
    """--config.split=dev scores the dev half's paragraphs (and declares nothing); a test
    run's items are the test half's paragraphs, one item each."""
    from experiments.serving import harness, harness_experiment as H
    dev, test = harness_docs["dev"], harness_docs["test"]
    # the halves are disjoint by topic; pydoc repeats a few paragraphs under topics of
    # both halves (docs/protocol.md "Dev by construction", known gap)
    assert dev and test and len(set(dev) & set(test)) < len(dev) / 5
    assert dev[0] not in test
    tok = common.tokenizer_only(None)
    out = H.write_tasks(tmp_path / "tasks", tok, 512, 5, "dev")
    written = [json.loads(x)["text"] for x in (out / "corpus_dev.jsonl").read_text()
               .splitlines()]
    assert written == dev[:5]
    assert "corpus_dev.jsonl" in (out / "servax_corpus_ppl.yaml").read_text()
    config = harness.get_config("small")
    items = H.test_items(config)
    assert len(items) == config.corpus_docs == 24 and {i.kind for i in items} == {"window"}
    assert [i.key for i in items] == [protocol.window_item(tok.encode(d), "x").key
                                      for d in test[:24]]
    dev_config = harness.get_config("small")
    dev_config.split = "dev"
    assert protocol.begin_test_run(H, dev_config, ledger_dir=tmp_path) is None
    assert "pydoc dev half" in H.test_items(dev_config)[0].what


def test_a_harness_rerun_reports_from_the_ledger_that_its_paragraphs_were_scored():
    """The committed serving_harness_small scored the 24 paragraphs: a rerun (or the same
    config under another name) counts every one of them; the committed run's own block is
    the per-paragraph count of the records made before it (9 of 24, up to 8 times), not
    the "none scored before" it reported with its run-name item."""
    from experiments.serving import harness, harness_experiment as H
    config = harness.get_config("small")
    counts = protocol.prior_counts(H.test_items(config), protocol.LEDGER_DIR)
    assert all(c["prior"] >= 1 for c in counts)
    assert all(c["by_technique"].get("serving", 0) >= 1 for c in counts)
    payload = json.loads((ROOT / "results/serving_harness_small/results.json").read_text())
    block = payload["protocol"]["items"]
    assert (block["items_total"], block["items_rescored"], block["max_prior_scorings"]) \
        == (24, 9, 8)
    assert block["corrected"] and block["declared_at_run"]["kinds"] == ["run"]
    assert not any("none scored before" in n for n in payload["notes"])
    assert all(c["measured"].endswith("re-scored (8)") for c in payload["claims"])
    table = (ROOT / "results/serving_harness_small/table.md").read_text()
    assert "none scored before" not in table and "re-scored (8)" in table


# -- commit_run ---------------------------------------------------------------------------

def _test_run(work, name, ledger_base, technique="fake", declared=True):
    """A test run as experiments.run writes it: its item record in the workdir ledger and
    results.json's protocol block with the ledger base it read."""
    items = None
    if declared:
        d = protocol.declare_test_items(technique, name, [protocol.content_item(
            "prompt", {"text": name})], ledger_dir=work / "ledger")
        protocol.complete_test_items(d, ledger_dir=work / "ledger")
        items = d.block("completed")
    block = {"technique": technique, "split": "test", "run_name": name, "items": items}
    if ledger_base != "absent":
        block["ledger_base"] = ledger_base
    (work / name).mkdir(parents=True)
    (work / name / "results.json").write_text(json.dumps(
        {"git": {"commit": "a" * 40, "dirty": False}, "protocol": block}))
    (work / name / "table.md").write_text("# run\n")


def test_commit_run_refuses_a_run_made_without_the_committed_ledger(tmp_path, capsys):
    work, results = tmp_path / "runs", tmp_path / "results"
    committed = str((results / "ledger").resolve())
    _test_run(work, "isolated", None)  # experiments.run --ledger_base=none
    _test_run(work, "elsewhere", str(tmp_path / "other"))  # --ledger_base=<another folder>
    _test_run(work, "checkout", protocol.COMMITTED_BASE)  # this checkout's, not `results`
    _test_run(work, "good", committed)
    _test_run(work, "old", "absent")  # made before the runner recorded its base
    args = [f"--workdir={work}", f"--results_dir={results}"]
    for run, why in [("isolated", "--ledger_base=none"), ("elsewhere", "other"),
                     ("checkout", protocol.COMMITTED_BASE)]:
        assert commit_run.main([run, *args]) == 1
        err = capsys.readouterr().err
        assert why in err and "not the committed ledger" in err, err
        assert commit_run.main([run, "--force", *args]) == 1  # --force does not help
        assert not (results / run).exists()
    assert not (results / "ledger").exists()  # nothing written when a run is refused
    assert commit_run.main(["good", "old", *args]) == 0
    out = capsys.readouterr().out
    assert "warning: old: made before the runner recorded" in out
    # the default results dir accepts the checkout's label
    assert commit_run.check("checkout", work, common.RESULTS_DIR) == []
    # a run whose item record is in neither ledger
    (work / "lost" / "results.json").parent.mkdir(parents=True)
    payload = json.loads((work / "good" / "results.json").read_text())
    payload["protocol"]["items"]["scoring_id"] = "never-recorded"
    (work / "lost" / "results.json").write_text(json.dumps(payload))
    with pytest.raises(commit_run.CommitError, match="neither"):
        commit_run.check("lost", work, results)


def test_the_runner_records_the_ledger_base_it_read():
    assert protocol.ledger_base_label(None) is None
    assert protocol.ledger_base_label(protocol.LEDGER_DIR) == protocol.COMMITTED_BASE
    assert protocol.ledger_base_label("/tmp/x") == str(Path("/tmp/x").resolve())
    source = (ROOT / "experiments/run.py").read_text()
    assert 'block["ledger_base"] = protocol.ledger_base_label(base_ledger_dir)' in source


# -- the run item -------------------------------------------------------------------------

def _module():
    import types
    return types.SimpleNamespace(__name__="fake", TECHNIQUE="fake", DEFAULTS_CHOSEN_ON="dev",
                                 defaults=lambda c: {"k": 1})  # no test_items: run item


def test_renaming_a_run_does_not_reset_its_run_item(tmp_path):
    cfg = lambda name, **kw: ConfigDict({"run_name": name, "split": "test", "seed": 0,  # noqa: E731
                                         "experiment": "fake", **kw})
    first = protocol.begin_test_run(_module(), cfg("fake_small"), ledger_dir=tmp_path)
    protocol.complete_test_items(first, ledger_dir=tmp_path)
    assert first.prior == [0] and first.items[0].kind == "run"
    renamed = protocol.begin_test_run(_module(), cfg("fake_renamed"), ledger_dir=tmp_path)
    assert renamed.prior == [1]  # same config, another name: the same item
    assert renamed.items[0].key == first.items[0].key
    other = protocol.begin_test_run(_module(), cfg("fake_other", seed=1), ledger_dir=tmp_path)
    assert other.prior == [0]  # another config under a new name: a new item
    assert (protocol.config_fingerprint(cfg("a")) == protocol.config_fingerprint(cfg("b"))
            != protocol.config_fingerprint(cfg("a", seed=1)))


def test_run_items_recorded_by_name_before_still_count(tmp_path):
    """The committed ledger holds run items keyed by run name (before issue 45): a rerun
    under that name counts them, whatever its config."""
    old = protocol.run_item("fake", "fake_small")  # the pre-45 key
    protocol.declare_test_items("fake", "fake_small", [old], ledger_dir=tmp_path)
    d = protocol.begin_test_run(_module(), ConfigDict(
        {"run_name": "fake_small", "split": "test", "seed": 3}), ledger_dir=tmp_path)
    assert d.prior == [1] and d.items[0].key != old.key
    # the committed run items (long-context and overhead rechecks) stay readable
    for ledger in protocol.item_ledgers():
        for key, entry in ledger["items"].items():
            protocol.Item.from_json(key, entry)


# -- notebooks and tests ------------------------------------------------------------------

SCORING_TESTS = ["tests/experiments/test_run.py", "tests/patchkv/test_patchkv_real.py"]


def _corpus_splits(path: Path) -> list[str]:
    """The literal splits `path` passes to data.corpus_text / load_text / split_text."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("corpus_text", "split_text")):
            out += [a.value for a in node.args[:1] if isinstance(a, ast.Constant)]
    return out


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks/src").glob("*.py")) + [
    ROOT / p for p in SCORING_TESTS], ids=lambda p: p.name)
def test_notebooks_and_model_tests_score_dev_or_calibration_text(path):
    """The notebooks (run by make test) and the tests that score the real model read the dev
    half or the calibration text, never the test half or the whole held-out text (which
    holds the test half): a score there would be recorded nowhere."""
    splits = _corpus_splits(path)
    assert not set(splits) - {"dev", "calibration"}, (path.name, splits)
    text = path.read_text()
    assert not re.search(r"text_split\W+test", text), path.name
    assert "ledger_base=none" not in text or path.name == "test_run.py"
