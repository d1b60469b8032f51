"""The serving experiment end to end on a tiny GGUF model: every section (HTTP sweep
through the real server, continuous vs static batching, TaSQ vs bf16 pages at equal
bytes, prefix cache, speculative decoding) runs and reports what it measured."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax

from research.model import init_params, tiny_config
from tests.model.gguf_writer import byte_vocab, write_llama_gguf

ROOT = Path(__file__).resolve().parents[2]

TINY = ["--config.engine.n_blocks=32", "--config.engine.block_size=8",
        "--config.engine.max_batch=4", "--config.engine.max_len=96",
        "--config.engine.token_budget=16", "--config.engine.prefill_chunk=16",
        "--config.workload.prompt_median=16", "--config.workload.max_prompt=32",
        "--config.workload.output_median=4", "--config.workload.max_output=8",
        "--config.sweep.rates=(4.0,)", "--config.sweep.n_requests=3",
        "--config.batching.n_requests=3", "--config.tasq.budget_bf16_blocks=16",
        "--config.tasq.max_batch=8", "--config.tasq.n_requests=6",
        "--config.tasq.prompt_tokens=16", "--config.tasq.max_tokens=4",
        "--config.tasq.calibration_seqs=2", "--config.prefix.group_sizes=(2,)",
        "--config.prefix.n_requests=4", "--config.prefix.prefix_tokens=24",
        "--config.prefix.suffix_tokens=8", "--config.spec.n_requests=2",
        "--config.spec.max_tokens=8", "--config.spec.passage_tokens=16"]


def test_serving_experiment_runs_every_section(tmp_path):
    config = tiny_config(vocab_size=len(byte_vocab()[0]), head_dim=16)
    gguf = write_llama_gguf(tmp_path / "tiny.gguf", config,
                            init_params(config, jax.random.key(0)))
    cmd = [sys.executable, "-m", "experiments.run",
           "--config=experiments/serving/serving.py:small", f"--workdir={tmp_path / 'w'}",
           f"--config.gguf_path={gguf}", *TINY]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "w" / "serving_small"
    result = json.loads((out / "results.json").read_text())
    assert result["extra"]["failed_sections"] in ({}, [], None)
    by_section = {}
    for row in result["rows"]:
        by_section.setdefault(row["section"], []).append(row)
    assert set(by_section) == {"sweep", "batching", "tasq", "prefix", "spec"}
    for rows in by_section.values():  # every request of every row served, none failed
        for row in rows:
            assert row["ok"] == row["requests"] > 0 and row["failed"] == 0, row
            assert row["out_tok_s"] > 0 and row["ttft_p50_ms"] > 0
    tasq = result["extra"]["tasq"]
    assert tasq["block_bytes"]["bf16"] == 16 * tasq["block_bytes"]["tasq-1bit"]
    assert (tasq["tasq-1bit"]["n_blocks"] * tasq["block_bytes"]["tasq-1bit"]
            == tasq["bf16"]["n_blocks"] * tasq["block_bytes"]["bf16"])  # same bytes
    prefix = result["extra"]["prefix"]
    on, off = prefix["group 2 cache on"], prefix["group 2 cache off"]
    assert on["cached_fraction"] > 0 == off["cached_fraction"]
    assert on["cost_per_m_at_0.05x"] < off["cost_per_m_at_0.05x"] == 2.0
    claims = {c["claim"] for c in result["claims"]}
    assert any("TaSQ 1-bit / bf16 peak concurrent" in c for c in claims)
    assert (out / "table.md").is_file() and (out / "plot.png").stat().st_size > 0
