"""The MegaFlux experiment end to end at toy size (training, resume, traces, sweep, report)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TOY = ["--config.train.dim=16", "--config.train.expert_ffn_dim=16", "--config.train.n_layers=1",
       "--config.train.seq_len=32", "--config.train.batch_size=4", "--config.train.steps=4",
       "--config.train.warmup=1", "--config.train.ckpt_every=2", "--config.traces.steps=2",
       "--config.traces.tokens_per_device=64", "--config.synthetic.steps=2",
       "--config.synthetic.tokens_per_device=64", "--config.synthetic.seeds=(0,)",
       "--config.synthetic.scenarios=((1.2, 0.0), (1.2, 0.5))", "--config.measure.steps=1",
       "--config.measure.repeats=1"]


@pytest.mark.slow  # ~2 min on 2 cores (the experiment twice); tests/megaflux: the layer
def test_megaflux_experiment_runs_and_resumes(tmp_path):
    """The second run finds the first one's final checkpoint (restored arrays are committed
    to one device) and must still run the 8-device layer check."""
    cmd = [sys.executable, "-m", "experiments.run",
           "--config=experiments/megaflux/megaflux.py:small", f"--workdir={tmp_path}", *TOY]
    for _ in range(2):
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "megaflux_small"
    result = json.loads((out / "results.json").read_text())
    methods = {row["method"] for row in result["rows"]}
    assert {"static EP", "EPLB", "capacity 1.25", "MegaFlux"} <= methods
    assert (out / "ckpt").is_dir() and (out / "traces.npz").is_file()
    assert str(out) in (out / "table.md").read_text()  # the report names where they are
