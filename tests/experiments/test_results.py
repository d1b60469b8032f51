"""Result files that can be checked: git state in results.json, what results/ commits,
committed runs carry their provenance, README numbers point at committed runs, plots
are labelled."""
import json
import re
import subprocess
from pathlib import Path

import pytest

from experiments import common

ROOT = Path(__file__).resolve().parents[2]
READMES = [ROOT / "README.md", *sorted(ROOT.glob("experiments/*/README.md"))]
RUN_PATH = re.compile(r"results/([A-Za-z0-9_.\-]+)")


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          check=True).stdout


@pytest.fixture
def repo(tmp_path):
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.com")
    _git(tmp_path, "config", "user.name", "t")
    (tmp_path / "code.py").write_text("x = 1\n")
    _git(tmp_path, "add", "code.py")
    _git(tmp_path, "commit", "-qm", "init")
    return tmp_path


def test_git_state_clean_then_dirty(repo):
    head = _git(repo, "rev-parse", "HEAD").strip()
    assert common.git_state(repo) == {"commit": head, "dirty": False, "dirty_count": 0,
                                      "dirty_paths": []}
    (repo / "code.py").write_text("x = 2\n")
    (repo / "new.py").write_text("")
    state = common.git_state(repo)
    assert state["commit"] == head and state["dirty"] is True
    assert sorted(state["dirty_paths"]) == ["code.py", "new.py"] and state["dirty_count"] == 2


def test_git_state_ignores_result_outputs(repo):
    (repo / "results" / "run").mkdir(parents=True)
    (repo / "results" / "run" / "results.json").write_text("{}")
    assert common.git_state(repo)["dirty"] is False


def test_git_state_caps_the_path_list(repo):
    for i in range(common.MAX_DIRTY_PATHS + 5):
        (repo / f"f{i}.txt").write_text("")
    state = common.git_state(repo)
    assert state["dirty_count"] == common.MAX_DIRTY_PATHS + 5
    assert len(state["dirty_paths"]) == common.MAX_DIRTY_PATHS


def test_git_state_outside_a_repository(tmp_path):
    state = common.git_state(tmp_path)
    assert state["commit"] is None and state["dirty"] is None and state["error"]


def test_git_state_bad_path_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="repo"):
        common.git_state(tmp_path / "missing")


def test_write_results_records_provenance(tmp_path, repo):
    def plot(fig):
        ax = fig.add_subplot(1, 1, 1)
        ax.bar([0, 1], [1.0, 2.0])
        ax.set_xticks([0, 1], ["a", "b"], fontsize=5)
        ax.set_title("load (max/mean)\nsmall run")

    report = common.Report(columns=["case", "load"], rows=[{"case": "a", "load": 1.0}],
                           title="t", plot=plot)
    git = common.git_state(repo)
    out = tmp_path / "out"
    common.write_results(report, out, {"k": 1}, 3, ["python", "-m", "experiments.run"],
                         1.234, git=git)
    payload = json.loads((out / "results.json").read_text())
    for key in common.REQUIRED_KEYS:
        assert key in payload, key
    assert payload["git"] == git and payload["seed"] == 3 and payload["config"] == {"k": 1}
    assert payload["command"] == "python -m experiments.run"
    assert (out / "table.md").read_text().startswith("# t")
    assert (out / "plot.png").stat().st_size > 0
    # without an explicit state, write_results takes this repository's
    common.write_results(report, out, {}, 0, ["x"], 0.0)
    own = json.loads((out / "results.json").read_text())["git"]
    assert re.fullmatch(r"[0-9a-f]{40}", own["commit"]) and isinstance(own["dirty"], bool)


def test_label_axes_fills_missing_labels_and_small_ticks():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = plt.figure()
    ax = fig.add_subplot(1, 1, 1)
    ax.bar([0, 1], [1.0, 2.0])
    ax.set_xticks([0, 1], ["zipf 0.8", "trained"], fontsize=5)
    ax.set_title("gamma (max/mean)\n8 devices")
    assert common.label_axes(fig, ["scenario", "gamma"]) == []
    assert ax.get_ylabel() == "gamma (max/mean)" and ax.get_title() == "8 devices"
    assert ax.get_xlabel() == "scenario"
    assert min(t.get_fontsize() for t in ax.get_xticklabels()) >= common.MIN_TICK_FONTSIZE
    # a numeric axis without labels is reported, not invented
    fig2 = plt.figure()
    fig2.add_subplot(1, 1, 1).plot([1, 2], [3, 4])
    assert common.label_axes(fig2, ["a"]) == ["axes 0"]
    plt.close(fig)
    plt.close(fig2)


def test_label_axes_slants_overlapping_tick_labels():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = plt.figure(figsize=(3, 3))
    ax = fig.add_subplot(1, 1, 1)
    names = [f"a rather long category name {i}" for i in range(6)]
    ax.bar(range(6), range(6))
    ax.set_xticks(range(6), names)
    ax.set_xlabel("category")
    ax.set_ylabel("value")
    assert common.label_axes(fig) == []
    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in ax.get_xticklabels()]
    assert all(t.get_rotation() > 0 for t in ax.get_xticklabels())
    assert not any(a.overlaps(b) for a, b in zip(boxes, boxes[1:]))
    plt.close(fig)


def test_gitignore_commits_only_result_files(tmp_path):
    paths = ["results/run/results.json", "results/run/table.md", "results/run/plot.png",
             "results/run/ckpt/state.npz", "results/run/traces.npz",
             "results/run/ckpt/results.json"]
    out = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", *paths],
                         capture_output=True, text=True).stdout.split()
    assert sorted(out) == sorted(paths[3:])


def _committed_runs() -> list[Path]:
    files = _git(ROOT, "ls-files", "results").split()
    # results/ledger/ is the dev/test protocol's ledger (experiments/protocol.py), not a run
    return sorted({ROOT / Path(f).parent for f in files} - {ROOT / "results" / "ledger"})


def test_committed_runs_carry_provenance():
    runs = _committed_runs()
    assert runs, "no committed results/<run>/"
    for run in runs:
        payload = json.loads((run / "results.json").read_text())
        missing = [k for k in common.REQUIRED_KEYS if k not in payload]
        assert not missing, f"{run.name}/results.json lacks {missing}"
        assert re.fullmatch(r"[0-9a-f]{40}", payload["git"]["commit"] or ""), run.name
        assert isinstance(payload["git"]["dirty"], bool), run.name
        assert payload["versions"].get("jax"), run.name
        assert payload["command"].startswith("python -m experiments."), run.name
        if payload["command"].startswith("python -m experiments.run"):
            assert (run / "table.md").is_file(), run.name
        block = payload.get("protocol")
        # every run under the protocol says how many of its test items were scored before
        # (the item ledger; runs older than it back-filled by experiments.backfill_items)
        assert block is None or "items" in block, f"{run.name}: no protocol items block"
        if block and block["split"] == "test":  # counted in the committed ledger
            ledger = json.loads((ROOT / "results" / "ledger" /
                                 f"{block['technique']}.json").read_text())
            entry = ledger["splits"][block["run_name"]]
            assert entry["defaults_fingerprint"] == block["defaults_fingerprint"], run.name
            assert 1 <= block["test_scorings"] <= entry["test_scorings"], run.name


def test_readme_results_paths_are_committed():
    committed = {p.name for p in _committed_runs()}
    cited = {(readme.relative_to(ROOT), name) for readme in READMES
             for name in RUN_PATH.findall(readme.read_text()) if name != "ledger"}
    missing = sorted((str(r), n) for r, n in cited if n not in committed)
    assert not missing, f"READMEs cite results/<run>/ that is not committed: {missing}"
    # the README that cites a run quotes the command's config next to it
    for readme, name in cited:
        command = json.loads((ROOT / "results" / name / "results.json").read_text())["command"]
        if not command.startswith("python -m experiments.run"):  # a dev sweep script
            assert command.split()[2] in (ROOT / readme).read_text(), (readme, name)
            continue
        config = next(a for a in command.split() if a.startswith("--config="))
        assert config[len("--config="):] in (ROOT / readme).read_text(), (readme, name)


def test_readmes_say_when_a_cited_run_was_re_scored():
    """A README that cites a run whose test items were scored k > 0 times before (its
    results.json protocol items block) says "re-scored (k)" somewhere (issue 36)."""
    missing = []
    for run in _committed_runs():
        block = (json.loads((run / "results.json").read_text()).get("protocol") or {})
        k = (block.get("items") or {}).get("max_prior_scorings", 0)
        if not k:
            continue
        for readme in READMES:
            text = readme.read_text()
            if f"results/{run.name}/" in text and f"re-scored ({k})" not in text:
                missing.append(f"{readme.relative_to(ROOT)}: {run.name} re-scored ({k})")
    assert not missing, missing
