"""The expert-parallel layer under jax.distributed: 2 CPU processes on localhost, each with
4 simulated devices, one 8-device mesh; both must match the single-process reference."""
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


# slow: two fresh Python processes that import JAX and compile the layer (~30-60 s on a
# shared 2-core machine).
@pytest.mark.slow
def test_two_process_layer_matches_reference(tmp_path):
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "experiments.megaflux.distributed_check", f"--process_id={i}",
         "--num_processes=2", f"--coordinator=localhost:{port}",
         f"--out={tmp_path / f'p{i}.json'}"], env=env, cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("distributed check timed out")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    reports = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2)]
    for i, r in enumerate(reports):
        assert r["process_id"] == i and r["process_count"] == 2
        assert r["device_count"] == 8 and r["local_devices"] == 4
        assert r["y_max_err"] < 2e-5 and r["grad_max_rel_err"] < 1e-5, str(r)
        assert r["replicas"] > 0
    assert reports[0]["device_load"] == reports[1]["device_load"]
