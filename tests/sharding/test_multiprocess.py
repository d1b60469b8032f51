"""Two processes under jax.distributed (gloo on CPU, 4 simulated devices each, one
data 2 x tensor 4 mesh across both): the sharded prefill and decode step agree with one
process (experiments/scaleout/distributed_check.py). Small: a 2-layer 8-head model."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_sharded_forward_and_decode_match_one_process(tmp_path):
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "experiments.scaleout.distributed_check", f"--process_id={i}",
         "--num_processes=2", f"--coordinator=localhost:{port}", "--tensor=4",
         f"--out={tmp_path / f'p{i}.json'}"], env=env, cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("distributed check timed out")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    reports = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2)]
    for i, r in enumerate(reports):
        assert r["process_id"] == i and r["process_count"] == 2, r
        assert r["device_count"] == 8 and r["local_devices"] == 4, r
        assert r["mesh"] == {"data": 2, "tensor": 4, "expert": 1}, r
        assert r["prefill_max_err"] < 1e-4 and r["decode_max_err"] < 1e-4, r
        assert r["greedy_equal"], r
        # tensor 4: every matrix split 4 ways, only norms replicated
        assert r["param_bytes_local_max"] < r["param_bytes_total"] / 3.5, r
