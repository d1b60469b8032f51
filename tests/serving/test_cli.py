"""The generation CLI on a tiny GGUF (the flags a user types)."""
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from research.model import init_params, tiny_config
from tests.model.gguf_writer import byte_vocab, write_llama_gguf

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~35 s: two CLI runs; test_cli_kv_codec_comes_from_the_registry runs it
def test_cli_generates_and_is_seeded(tmp_path):
    config = tiny_config(vocab_size=len(byte_vocab()[0]), head_dim=16)
    path = write_llama_gguf(tmp_path / "t.gguf", config, init_params(config, jax.random.key(0)))
    cmd = [sys.executable, "-m", "research.serving.cli", f"--gguf={path}", "--prompt=the",
           "--prompt=thin tin", "--max_new_tokens=5", "--temperature=1.0", "--seed=3"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = [subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert runs[0].returncode == 0, runs[0].stderr[-2000:]
    assert "### the\n" in runs[0].stdout and "### thin tin\n" in runs[0].stdout
    assert runs[0].stdout == runs[1].stdout


def test_cli_names_a_non_utf8_prompt(tmp_path):
    cmd = [sys.executable.encode(), b"-m", b"research.serving.cli", b"--gguf=unused.gguf",
           b"--prompt=fine", b"--prompt=caf\xe9"]  # latin-1 bytes on the command line
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert "--prompt #2 is not valid UTF-8 text: character 3 is byte 0xe9" in proc.stderr


def test_cli_kv_codec_comes_from_the_registry(tmp_path):
    """--kv_codec takes every registered codec (int8 here) and refuses other names."""
    config = tiny_config(vocab_size=len(byte_vocab()[0]), head_dim=16)
    path = write_llama_gguf(tmp_path / "t.gguf", config, init_params(config, jax.random.key(0)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    base = [sys.executable, "-m", "research.serving.cli", f"--gguf={path}", "--nochat",
            "--prompt=the", "--max_new_tokens=4"]
    ok = subprocess.run(base + ["--kv_codec=int8"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "### the\n" in ok.stdout
    bad = subprocess.run(base + ["--kv_codec=int3"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode != 0 and "kv_codec" in bad.stderr and "tasq-1bit" in bad.stderr


def test_cli_refuses_sampling_flags_out_of_bounds_by_name():
    """The CLI checks --temperature / --top_k / --top_p with the bounds the server uses
    (research/decode/sampling.py), before loading a model: a usage error, no traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for flag, bound in (("--top_p=0", "--top_p must be a number in (0, 1]"),
                        ("--temperature=-1", "--temperature must be a number in [0, 100]"),
                        ("--top_k=-2", "--top_k must be an integer >= 0")):
        proc = subprocess.run([sys.executable, "-m", "research.serving.cli",
                               "--gguf=unused.gguf", "--prompt=hi", flag], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert bound in proc.stderr, proc.stderr[-2000:]
