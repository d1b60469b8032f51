"""The experiment runner end to end: the baseline experiment on a tiny GGUF model."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from research.model import init_params, tiny_config
from tests.model.gguf_writer import byte_vocab, write_llama_gguf

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    config = tiny_config(vocab_size=len(byte_vocab()[0]), head_dim=16)
    path = write_llama_gguf(d / "tiny.gguf", config, init_params(config, jax.random.key(0)))
    text = d / "text.txt"
    text.write_text("the thin tin in the thin inn. " * 20)
    return path, text


def _run_config(config, workdir, *overrides):
    """`python -m experiments.run --config=<config> --workdir=<workdir> <overrides>`."""
    cmd = [sys.executable, "-m", "experiments.run", f"--config={config}",
           f"--workdir={workdir}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def _run(workdir, *overrides):
    return _run_config("experiments/baseline/baseline.py:small", workdir, *overrides)


def _tiny_overrides(tiny_gguf):
    path, text = tiny_gguf
    return [f"--config.gguf_path={path}", f"--config.text_path={text}",
            "--config.ppl.window=32", "--config.ppl.stride=16", "--config.ppl.max_windows=4",
            "--config.throughput.prompt_len=8", "--config.throughput.new_tokens=4",
            "--config.throughput.repeats=1", "--config.sample.max_new_tokens=4"]


def test_baseline_runs_and_is_reproducible(tmp_path, tiny_gguf):
    runs = []
    for i in range(2):  # w1 counts its own ledger alone (--ledger_base=none)
        isolated = ["--ledger_base=none"] if i else []
        proc = _run(tmp_path / f"w{i}", *_tiny_overrides(tiny_gguf), *isolated)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = tmp_path / f"w{i}" / "baseline_small"
        assert (out / "table.md").read_text().startswith("# servax baseline")
        runs.append(json.loads((out / "results.json").read_text()))
    r = runs[0]
    # which ledger the counts read: experiments.commit_run refuses the isolated run
    assert [x["protocol"]["ledger_base"] for x in runs] == ["results/ledger", None]
    assert r["seed"] == 0 and r["config"]["ppl"]["window"] == 32
    assert r["versions"]["jax"] == jax.__version__
    assert r["command"].startswith("python -m experiments.run --config=")  # no local path
    assert len(r["git"]["commit"]) == 40 and isinstance(r["git"]["dirty"], bool)
    # the dev/test protocol: a test run, written once to its workdir's ledger and counted
    # after the committed ledger's scorings of the same run name and defaults
    assert r["protocol"]["technique"] == "baseline" and r["protocol"]["split"] == "test"
    from experiments import protocol
    committed = protocol.read_ledger("baseline")["splits"].get("baseline_small")
    prior = (committed["test_scorings"] if committed and committed["defaults_fingerprint"]
             == r["protocol"]["defaults_fingerprint"] else 0)
    assert r["protocol"]["test_scorings"] == prior + 1
    assert runs[1]["protocol"]["test_scorings"] == 1
    ledger = json.loads((tmp_path / "w0" / "ledger" / "baseline.json").read_text())
    assert ledger["splits"]["baseline_small"]["test_scorings"] == 1
    assert [row["perplexity"] for row in r["rows"]] == [row["perplexity"]
                                                         for row in runs[1]["rows"]]
    assert "| float32 |" in (tmp_path / "w0" / "baseline_small" / "table.md").read_text()


def test_unknown_config_key_is_a_one_line_error(tmp_path):
    proc = _run(tmp_path, "--config.ppl.windo=1")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "ppl.windo" in ln]
    assert len(lines) == 1 and "did you mean 'ppl.window'" in lines[0], proc.stderr[-2000:]


def test_unknown_override_names_the_key_and_close_matches():
    from ml_collections import ConfigDict
    from experiments.run import unknown_override
    config = ConfigDict({"seed": 0, "ppl": {"window": 128, "stride": 64}})
    assert unknown_override(config, ["run", "--config=x.py", "--config.ppl.window=3",
                                     "--workdir=w"]) is None
    msg = unknown_override(config, ["--config.ppl.windo=3"])
    assert "'ppl.windo'" in msg and "did you mean 'ppl.window'?" in msg
    msg = unknown_override(config, ["--config.zzz=1"])
    assert "'zzz'" in msg and "the config has ppl, seed" in msg
    msg = unknown_override(config, ["--config.ppl.window.x=1"])
    assert "ppl.window is a leaf of type int" in msg


def test_bad_config_arg_is_an_error(tmp_path):
    cmd = [sys.executable, "-m", "experiments.run",
           "--config=experiments/baseline/baseline.py:huge", f"--workdir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode != 0 and "'small' or 'full'" in proc.stderr


@pytest.mark.slow  # real SmolLM2 baseline: ~2-3 minutes on 2 cores
def test_real_baseline_small(tmp_path):
    proc = _run(tmp_path, "--config.text_split=dev")  # a test never scores the test half
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "baseline_small" / "results.json").read_text())
    f32, bf16 = r["rows"]
    assert 10 < f32["perplexity"] < 40
    assert abs(bf16["perplexity"] / f32["perplexity"] - 1) < 0.01
    assert "Paris" in r["extra"]["sample"]
