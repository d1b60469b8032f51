"""docs/extending.md's "Recipe: a new transform" walked end to end, in a copy of this
checkout (the repo's own tree is never written): a toy technique package (step 1), its unit
test on the tiny model (step 2), a config + experiment module with the protocol's
declarations (step 3), BUILD regeneration (step 5), a dev run, a test run and
`experiments.commit_run` (step 4). The checkout's own checks (public API, BUILD, import
graph) must pass with the new files in place."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.experiments.test_run import tiny_gguf  # noqa: F401 - the fixture: a tiny GGUF

ROOT = Path(__file__).resolve().parents[2]

# Step 1: the transform, in research/<technique>/, exported from the package.
TRANSFORM = '''\
"""Round-to-nearest weight rounding: each 2-D weight matrix stored on a symmetric grid of
2**(bits-1) - 1 levels a side, its scale the matrix's absolute maximum (calibrated once)."""
import jax
import jax.numpy as jnp

from research.transforms import Transform


def round_weights(bits: int = 8) -> Transform:
    if not isinstance(bits, int) or not 2 <= bits <= 16:
        raise ValueError(f"bits must be an int in [2, 16], got {bits!r}")
    levels = 2 ** (bits - 1) - 1

    def calibrate(model, data):
        del data  # the scales come from the weights alone
        return jax.tree.map(lambda w: jnp.max(jnp.abs(w)) if w.ndim == 2 else None,
                            model.params)

    def apply(model, scales):
        def rounded(w, s):
            if s is None:
                return w
            return (jnp.round(w / s * levels) * (s / levels)).astype(w.dtype)
        return model.replace(params=jax.tree.map(rounded, model.params, scales))

    return Transform(calibrate, apply, f"round_weights({bits})")
'''
INIT = '''\
"""Toy round: weight rounding to a symmetric grid (docs/extending.md's recipe, walked by a test)."""
from research.toyround.transform import round_weights

__all__ = ["round_weights"]
'''
# Step 2: its test on the tiny random model.
UNIT_TEST = '''\
import jax.numpy as jnp
import numpy as np
import pytest

from research.model import forward
from research.toyround import round_weights
from research.transforms import calibrate_and_apply


def test_rounding_keeps_the_model_close_and_moves_every_matrix(tiny):
    tokens = jnp.arange(12, dtype=jnp.int32)[None] % tiny.config.vocab_size
    ref = np.asarray(forward(tiny, tokens).logits)
    model, _ = calibrate_and_apply(round_weights(8), tiny, None)
    got = np.asarray(forward(model, tokens).logits)
    assert 0 < np.max(np.abs(got - ref)) < 0.05 * np.max(np.abs(ref))
    coarse, _ = calibrate_and_apply(round_weights(2), tiny, None)
    coarse_error = np.max(np.abs(np.asarray(forward(coarse, tokens).logits) - ref))
    assert coarse_error > np.max(np.abs(got - ref))


def test_bad_bits_are_refused():
    with pytest.raises(ValueError, match="bits must be an int"):
        round_weights(1)
'''
# Step 3: the config (the run) and the experiment module beside it.
CONFIG = '''\
r"""Toy round: perplexity of the model with its weights rounded to int8 vs as loaded.

Command:   python -m experiments.run --config=experiments/toyround/toyround.py:small
Hardware:  CPU; seconds on the tiny model of the recipe's test.
Expected:  int8 rounding within 1% of the loaded model's perplexity.
"""
from experiments import common


def get_config(arg: str = "small"):
    c = common.new_config(arg, "experiments.toyround.experiment", args=("dev", "small"))
    c.split = "dev" if arg == "dev" else "test"
    c.text_path = ""  # empty: the split's half of the held-out prose
    c.bits = 8
    c.window, c.stride, c.max_windows = 256, 128, 8
    return c
'''
EXPERIMENT = '''\
"""Toy round's experiment (see toyround.py for the command)."""
from experiments import common, protocol
from research import data
from research.eval.perplexity import perplexity, windows
from research.model import load
from research.model import forward
from research.toyround import round_weights
from research.transforms import calibrate_and_apply

TECHNIQUE = "toyround"
DEFAULTS_CHOSEN_ON = "python -m experiments.run --config=experiments/toyround/toyround.py:dev"


def defaults(config) -> dict:
    return {"bits": config.bits}


def _ids(config):
    tok = common.tokenizer_only(config.gguf_path or None)
    return tok.encode(data.load_text(config.text_path, split=config.split))


def test_items(config) -> list:
    ids = _ids(config)
    spans = [(w.begin, w.end) for w in windows(len(ids), config.window, config.stride)
             [:config.max_windows]]
    return protocol.text_windows(ids, spans, config.text_path or f"pydoc {config.split} half")


def run(config, out_dir) -> common.Report:
    del out_dir
    model, tok = load(config.gguf_path or None)
    ids = tok.encode(data.load_text(config.text_path, split=config.split))
    rows = []
    for name, m in (("as loaded", model),
                    (f"int{config.bits}", calibrate_and_apply(round_weights(config.bits),
                                                               model, None)[0])):
        p = perplexity(m, ids, window=config.window, stride=config.stride,
                       max_windows=config.max_windows)
        rows.append({"weights": name, "perplexity": p.ppl, "scored_tokens": p.n_tokens})
    gap = rows[1]["perplexity"] / rows[0]["perplexity"] - 1
    return common.Report(
        columns=["weights", "perplexity", "scored_tokens"], rows=rows,
        title="toy round: weight rounding",
        claims=[common.claim(f"int{config.bits} perplexity within 1%", "<= 1%", f"{gap:+.2%}",
                             abs(gap) <= 0.01)])
'''
RECIPE_FILES = {
    "research/toyround/transform.py": TRANSFORM,
    "research/toyround/__init__.py": INIT,
    "tests/toyround/__init__.py": "",
    "tests/toyround/test_toyround.py": UNIT_TEST,
    "experiments/toyround/__init__.py": "",
    "experiments/toyround/toyround.py": CONFIG,
    "experiments/toyround/experiment.py": EXPERIMENT,
}


def _git(tree: Path, *args) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True,
                          text=True, env=env).stdout


def _copy_checkout(dst: Path) -> Path:
    """The working tree's files (tracked, and untracked ones git does not ignore), as a
    fresh one-commit checkout at `dst`: what a newcomer clones."""
    listed = _git(ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    for rel in filter(None, listed.split("\0")):
        src = ROOT / rel
        if src.is_file():  # a file deleted in the working tree is not copied
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    _git(dst, "init", "-q")
    _git(dst, "add", "-A")
    _git(dst, "commit", "-q", "-m", "checkout")
    return dst


def _python(tree: Path, *args, timeout=900):
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_the_transform_recipe_end_to_end(tmp_path, tiny_gguf):  # noqa: F811
    recipe = (ROOT / "docs" / "extending.md").read_text()
    for step in ("research/<technique>/", "get_config(arg)", "common.new_config(arg, "
                 "experiment", "TECHNIQUE", "DEFAULTS_CHOSEN_ON", "defaults(config)",
                 "python -m experiments.commit_run <run>", "python scripts/gen_build.py"):
        assert step in recipe, f"docs/extending.md no longer says {step!r}: update this test"
    tree = _copy_checkout(tmp_path / "checkout")
    for rel, text in RECIPE_FILES.items():  # steps 1-3
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)

    # step 5: BUILD regenerated, with a target for each new package and test
    _python(tree, "scripts/gen_build.py")
    build = (tree / "BUILD").read_text()
    for target in ("research_toyround", "experiments_toyround", "tests_toyround_test_toyround"):
        assert f'name = "{target}"' in build
    # step 2 and the checkout's own checks, with the technique in place
    out = _python(tree, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "tests/toyround",
                  "tests/test_public_api.py", "tests/test_build.py", "tests/test_import_graph.py")
    for name in ("test_rounding_keeps_the_model_close_and_moves_every_matrix",
                 "test_bad_bits_are_refused"):
        assert f"PASSED tests/toyround/test_toyround.py::{name}" in out, out[-2000:]

    # step 4: choose on dev, score the test split once, commit the run
    gguf, text = tiny_gguf
    (tmp_path / "dev.txt").write_text("a dog and a cat sat on the mat by the door. " * 12)
    workdir = tmp_path / "runs"
    for arg, text_path in (("dev", tmp_path / "dev.txt"), ("small", text)):
        _python(tree, "-m", "experiments.run",
                f"--config=experiments/toyround/toyround.py:{arg}", f"--workdir={workdir}",
                f"--config.gguf_path={gguf}", f"--config.text_path={text_path}",
                "--config.window=32", "--config.stride=16", "--config.max_windows=4")
    dev = json.loads((workdir / "toyround_dev" / "results.json").read_text())
    assert dev["protocol"]["split"] == "dev"
    log = _python(tree, "-m", "experiments.commit_run", "toyround_small", f"--workdir={workdir}")
    result = json.loads((tree / "results" / "toyround_small" / "results.json").read_text())
    assert result["protocol"]["split"] == "test" and result["protocol"]["technique"] == "toyround"
    assert [r["weights"] for r in result["rows"]] == ["as loaded", "int8"]
    assert all(r["perplexity"] > 1 for r in result["rows"])
    assert result["claims"][0]["claim"] == "int8 perplexity within 1%"
    assert (tree / "results" / "toyround_small" / "table.md").read_text().startswith(
        "# toy round")
    ledger = json.loads((tree / "results" / "ledger" / "toyround.json").read_text())
    assert ledger["splits"]["toyround_small"]["test_scorings"] == 1, log
    # what the newcomer commits: the recipe's files, BUILD, the run and its ledger records
    changed = {line[3:] for line in _git(tree, "status", "--porcelain",
                                         "--untracked-files=all").splitlines()}
    assert changed == set(RECIPE_FILES) | {"BUILD"} | {
        p for p in changed if p.startswith(("results/toyround_small/", "results/ledger/"))}
