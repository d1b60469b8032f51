"""The DynaCore experiment end to end on a tiny GGUF model: the dev choice among the
SmoothQuant strengths and the W4A16 grids / methods, the test rows with the chosen
settings and the HLO check (default suite); CPU speed and the measured two-process KV
handoff (slow: two more subprocesses; their pieces are tested in tests/dynacore)."""
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

TINY = ["--config.quality.window=32", "--config.quality.n_prefill=16",
        "--config.quality.dev_windows=2", "--config.quality.test_windows=2",
        "--config.quality.cal_seqs=2", "--config.quality.group_sizes=(32,64)",
        "--config.speed.prompt=16", "--config.speed.context=16", "--config.speed.decode=4",
        "--config.speed.repeats=1", "--config.speed.peer_python=",
        "--config.disagg.prompts=(16,)", "--config.disagg.repeats=1",
        "--config.disagg.decode_tokens=2", "--config.disagg.tasq_seqs=2",
        "--config.disagg.tasq_iters=2"]


def _run(tmp_path, *extra):
    config = tiny_config(vocab_size=len(byte_vocab()[0]), dim=64, n_heads=4, n_kv_heads=2,
                         head_dim=16, ffn_dim=128)  # every input dim divisible by 64
    gguf = write_llama_gguf(tmp_path / "tiny.gguf", config,
                            init_params(config, jax.random.key(0)))
    cmd = [sys.executable, "-m", "experiments.run",
           "--config=experiments/dynacore/dynacore.py:small", f"--workdir={tmp_path / 'w'}",
           f"--config.gguf_path={gguf}", *TINY, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / "w" / "dynacore_small" / "results.json").read_text())


@pytest.mark.slow  # ~80 s on 2 cores; tests/dynacore covers the transforms
def test_dynacore_experiment_chooses_on_dev_and_scores_the_choice(tmp_path):
    result = _run(tmp_path, "--config.sections=quality,hlo")
    q = result["extra"]["quality"]
    # every candidate scored on dev: W8A8 off + 3 strengths, 3 grids x 2 methods
    assert len(q["dev_rows"]) == 4 + 6
    w8, w4 = q["w8a8"], q["w4a16"]
    assert w8["smooth"] is None or w8["smooth"] in (0.3, 0.5, 0.8)
    by = {r["setting"]: r for r in result["rows"]}
    dc = next(name for name in by if name.startswith("DynaCore"))
    assert w4["group_size"] == 64 and w4["zero_point"] in ("none", "int", "float")
    for name in ("f32", "bf16", "W8A16", dc):
        assert by[name]["ppl all"] > 0 and by[name]["KL decoded"] >= 0
    assert by["f32"]["KL decoded"] == 0
    claims = {c["claim"] for c in result["claims"]}
    assert any("within 1% of f32" in c for c in claims)
    assert set(result["extra"]["missing_sections"]) == {"speed", "handoff"}


@pytest.mark.slow
def test_dynacore_experiment_reports_speed_and_handoff(tmp_path):
    result = _run(tmp_path)
    w8 = result["extra"]["quality"]["w8a8"]
    titles = [t["title"] for t in result["tables"]]
    assert any(t.startswith("Measured KV handoff") for t in titles)
    speed = next(t for t in result["tables"] if t["title"].startswith("CPU speed"))
    variants = {r["variant"] for r in speed["rows"]}
    # + the chosen W8A8 and W4A16, and plain W8A8 beside a smoothed choice
    assert {"f32", "bf16"} <= variants
    assert len(variants) == 4 + (w8["smooth"] is not None)
    assert all(r["tok/s"] > 0 for r in speed["rows"])
