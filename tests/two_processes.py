"""Run an `experiments.<x>.distributed_check` module as two jax.distributed processes on
localhost (gloo on CPU, 4 simulated devices each) and return each process's JSON report."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_two_processes(module: str, tmp_path: Path, *, timeout: float,
                      extra_args: tuple[str, ...] = ()) -> list[dict]:
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    procs = [subprocess.Popen(
        [sys.executable, "-m", module, f"--process_id={i}", "--num_processes=2",
         f"--coordinator=localhost:{port}", *extra_args, f"--out={tmp_path / f'p{i}.json'}"],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("distributed check timed out")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2)]
