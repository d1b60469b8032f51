"""Runs write to a workdir, never to results/; committing a run there is its own step
(experiments/commit_run.py), which merges the workdir's ledger records into the committed
ledger. A fresh clone stays clean after a run."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ml_collections import ConfigDict

from experiments import commit_run, common, protocol

ROOT = Path(__file__).resolve().parents[2]


def _module(defaults, items=None):
    import types
    m = types.SimpleNamespace(__name__="fake", TECHNIQUE="fake", DEFAULTS_CHOSEN_ON="dev",
                              defaults=lambda c: defaults)
    if items is not None:
        m.test_items = lambda c: items
    return m


def _count(cfg, defaults, work, base):
    return protocol.protocol_block(_module(defaults), cfg, ledger_dir=work,
                                   base_ledger_dir=base)["test_scorings"]


def test_run_ledger_counts_committed_and_workdir_records_and_merges_once(tmp_path):
    base, work = tmp_path / "committed", tmp_path / "work"
    cfg = ConfigDict({"run_name": "fake_small", "split": "test"})
    assert [_count(cfg, {"k": 1}, base, None) for _ in range(2)] == [1, 2]
    assert _count(cfg, {"k": 1}, work, base) == 3  # 2 committed + 1 in the workdir
    assert protocol.read_ledger("fake", work)["splits"]["fake_small"]["test_scorings"] == 1
    assert protocol.read_ledger("fake", base)["splits"]["fake_small"]["test_scorings"] == 2
    assert protocol.merge_ledgers(work, base)
    assert protocol.merge_ledgers(work, base) == []  # idempotent: records matched by id
    assert protocol.read_ledger("fake", base)["splits"]["fake_small"]["test_scorings"] == 3
    assert _count(cfg, {"k": 1}, work, base) == 4  # the merged record is not counted twice
    protocol.merge_ledgers(work, base)
    entry = protocol.read_ledger("fake", base)["splits"]["fake_small"]
    assert entry["test_scorings"] == 4 == len(entry["runs"])
    # defaults changed in the workdir: the count restarts there and in the merge
    assert _count(cfg, {"k": 2}, work, base) == 1
    protocol.merge_ledgers(work, base)
    entry = protocol.read_ledger("fake", base)["splits"]["fake_small"]
    assert entry["test_scorings"] == 1 and entry["defaults"] == {"k": 2}
    # the same folder as its own base counts once
    assert _count(cfg, {"k": 2}, base, base) == 2


def test_item_ledger_reads_committed_records_and_merges_them_by_id(tmp_path):
    base, work = tmp_path / "committed", tmp_path / "work"
    items = [protocol.content_item("prompt", {"text": "a"})]
    cfg = ConfigDict({"run_name": "fake_small", "split": "test"})
    d = protocol.begin_test_run(_module({"k": 1}, items), cfg, ledger_dir=base)
    protocol.complete_test_items(d, ledger_dir=base)
    started = protocol.begin_test_run(_module({"k": 1}, items), cfg, ledger_dir=work,
                                      base_ledger_dir=base)
    assert started.prior == [1]  # the committed record counts
    assert not (base / "items_fake.json").read_text().count(started.scoring_id)
    protocol.merge_ledgers(work, base)  # merged while "started" (aborted or running)
    protocol.complete_test_items(started, ledger_dir=work)
    protocol.merge_ledgers(work, base)  # the completed record replaces it
    ledger = protocol.read_item_ledger("fake", base)
    assert [r["status"] for r in ledger["scorings"]] == ["completed", "completed"]
    third = protocol.begin_test_run(_module({"k": 1}, items), cfg, ledger_dir=work,
                                    base_ledger_dir=base)
    assert third.prior == [2]  # base and workdir hold the merged record once


def _fake_run(workdir, name, commit, plot=True, technique="fake"):
    out = workdir / name
    out.mkdir(parents=True)
    (out / "results.json").write_text(json.dumps(
        {"git": {"commit": commit, "dirty": False}, "protocol": {"technique": technique}}))
    (out / "table.md").write_text(f"# {commit}\n")
    (out / "ckpt.npz").write_text("not committed")
    if plot:
        (out / "plot.png").write_bytes(b"png")


def test_commit_run_copies_the_committed_files_and_merges_the_ledger(tmp_path, capsys):
    work, results = tmp_path / "runs", tmp_path / "results"
    cfg = ConfigDict({"run_name": "fake_small", "split": "test"})
    _count(cfg, {"k": 1}, work / "ledger", results / "ledger")
    _fake_run(work, "fake_small", "a" * 40)
    args = ["fake_small", f"--workdir={work}", f"--results_dir={results}"]
    assert commit_run.main(args) == 0
    assert sorted(p.name for p in (results / "fake_small").iterdir()) == sorted(
        common.COMMITTED_FILES)
    ledger = protocol.read_ledger("fake", results / "ledger")
    assert ledger["splits"]["fake_small"]["test_scorings"] == 1
    assert commit_run.main(args) == 0  # same commit: a rerun may replace it; ledger once
    assert protocol.read_ledger("fake", results / "ledger")["splits"]["fake_small"][
        "test_scorings"] == 1
    # a run made at another commit is not overwritten without --force
    shutil.rmtree(work / "fake_small")
    _fake_run(work, "fake_small", "b" * 40, plot=False)
    assert commit_run.main(args) == 1
    assert "--force" in capsys.readouterr().err
    assert (results / "fake_small" / "table.md").read_text() == f"# {'a' * 40}\n"
    assert commit_run.main(args + ["--force"]) == 0
    assert (results / "fake_small" / "table.md").read_text() == f"# {'b' * 40}\n"
    assert not (results / "fake_small" / "plot.png").exists()  # the new run has none
    assert commit_run.main(["missing", f"--workdir={work}", f"--results_dir={results}"]) == 1
    assert commit_run.main([f"--workdir={work}", f"--results_dir={results}"]) == 0


def test_the_default_workdir_is_ignored_by_git(monkeypatch):
    monkeypatch.delenv("SERVAX_WORKDIR", raising=False)
    work = common.default_workdir()
    assert work == ROOT / "runs"
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    for path in ("runs/baseline_small/results.json", "runs/ledger/baseline.json"):
        assert subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", path]).returncode \
            == 0, path
    monkeypatch.setenv("SERVAX_WORKDIR", "/elsewhere")
    assert common.default_workdir() == Path("/elsewhere")


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          check=True).stdout


def _clone_of_the_working_tree(dst: Path) -> None:
    """`git clone --local` of this checkout, with the working tree's uncommitted changes
    committed in the clone (so the test checks this code, not only HEAD's)."""
    subprocess.run(["git", "clone", "-q", "--local", str(ROOT), str(dst)], check=True)
    listed = _git(ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    for rel in filter(None, listed.split("\0")):
        src, out = ROOT / rel, dst / rel
        if src.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, out)
        elif out.is_file() or out.is_symlink():
            out.unlink()  # deleted in the working tree
    _git(dst, "add", "-A")
    _git(dst, "-c", "user.name=test", "-c", "user.email=test@example.com", "commit", "-q",
         "--allow-empty", "-m", "the working tree")


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs git and a git checkout")
def test_a_fresh_clone_stays_clean_after_a_run(tmp_path):
    """`experiments.run` in a fresh clone (default workdir, default committed ledger) leaves
    `git status` empty; `experiments.commit_run` is what changes results/.

    A full `make demo` (the real SmolLM2 baseline, minutes on 2 cores) is too slow for the
    test suite: this runs the same command, the baseline config, on a tiny random GGUF model
    and a short text (tests/experiments/test_run.py's overrides), which exercises the same
    paths: result folder, run ledger, item ledger, git state."""
    import jax

    from research.model import init_params, tiny_config
    from tests.experiments.test_run import _tiny_overrides
    from tests.model.gguf_writer import byte_vocab, write_llama_gguf
    config = tiny_config(vocab_size=len(byte_vocab()[0]), head_dim=16)
    gguf = write_llama_gguf(tmp_path / "tiny.gguf", config,
                            init_params(config, jax.random.key(0)))
    text = tmp_path / "text.txt"
    text.write_text("the thin tin in the thin inn. " * 20)
    clone = tmp_path / "clone"
    _clone_of_the_working_tree(clone)
    assert _git(clone, "status", "--porcelain") == ""
    env = {k: v for k, v in os.environ.items() if k != "SERVAX_WORKDIR"}
    env["PYTHONPATH"] = str(clone)
    cmd = [sys.executable, "-m", "experiments.run",
           "--config=experiments/baseline/baseline.py:small", *_tiny_overrides((gguf, text))]
    proc = subprocess.run(cmd, cwd=clone, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "experiments.commit_run baseline_small" in proc.stdout
    assert _git(clone, "status", "--porcelain", "--untracked-files=all") == ""
    r = json.loads((clone / "runs" / "baseline_small" / "results.json").read_text())
    assert r["git"]["dirty"] is False  # the clone's code ran, on a clean tree
    assert (clone / "runs" / "ledger" / "items_baseline.json").is_file()
    # committing is the explicit step that changes results/ (and only results/)
    proc = subprocess.run([sys.executable, "-m", "experiments.commit_run", "baseline_small",
                           "--force"], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    changed = {line[3:] for line in _git(clone, "status", "--porcelain",
                                         "--untracked-files=all").splitlines()}
    assert changed and all(p.startswith("results/") for p in changed), changed
    assert "results/ledger/baseline.json" in changed
