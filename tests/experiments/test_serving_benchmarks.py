"""The engine-overhead and long-context serving benchmarks end to end on a tiny GGUF
model: every row measured, claims computed, no compiles while serving."""
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
def gguf(tmp_path_factory):
    config = tiny_config(vocab_size=len(byte_vocab()[0]), head_dim=16, max_position=512)
    return write_llama_gguf(tmp_path_factory.mktemp("g") / "tiny.gguf", config,
                            init_params(config, jax.random.key(0)))


def _run(config: str, gguf, workdir, *overrides) -> dict:
    cmd = [sys.executable, "-m", "experiments.run", f"--config={config}",
           f"--workdir={workdir}", f"--config.gguf_path={gguf}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = next(p for p in Path(workdir).iterdir() if (p / "results.json").is_file())
    return json.loads((name / "results.json").read_text())


@pytest.mark.slow  # ~45 s: the benchmark's machinery end to end (make test stays < 20 min)
def test_overhead_benchmark(gguf, tmp_path):
    result = _run("experiments/serving/overhead.py:small", gguf, tmp_path,
                  "--config.codecs=('bf16','tasq-1bit')", "--config.batches=(2,)",
                  "--config.prompt_tokens=16", "--config.new_tokens=6", "--config.rounds=1",
                  "--config.max_len=64", "--config.block_size=8", "--config.prefill_chunk=16",
                  "--config.calibration_seqs=2", "--config.profile_reps=2")
    assert [(r["codec"], r["batch"]) for r in result["rows"]] == [("bf16", 2),
                                                                  ("tasq-1bit", 2)]
    for r in result["rows"]:
        assert r["generate_tok_s"] > 0 and r["engine_tok_s"] > 0
        assert 0 < r["forward_share"] <= 1 and r["host_share"] < 1
        assert r["generate_compile_s"] >= 0 and r["engine_compile_s"] >= 0
        assert len(r["generate_tok_s_rounds"]) == len(r["engine_tok_s_rounds"]) == 1
    assert len(result["claims"]) == 4
    assert len(result["extra"]["profile"]) == 6  # 3 sampler rows, 3 pool sizes
    assert all(r["ms"] > 0 for r in result["extra"]["profile"])


def test_overhead_timing_warms_both_sides_and_reports_compile_apart(monkeypatch):
    """The first batch of each side (its compile) is never a timed round: with a first
    call 10 s slower, both tok/s come from the warm rounds alone and the 10 s shows up in
    the compile columns; both sides are timed over the same b x (new_tokens - 1) steps."""
    from experiments.serving import overhead_experiment as ox
    calls = {"gen": 0, "eng": 0}

    def fake_generate(model, prompts, new_tokens):
        calls["gen"] += 1
        extra = 10.0 if calls["gen"] == 1 else 0.0
        return {"wall_s": 1.5 + extra, "decode_s": 1.0 + extra}

    def fake_engine(engine, prompts, new_tokens, tag):
        calls["eng"] += 1
        extra = 10.0 if tag.startswith("warm") else 0.0
        return {"wall_s": 1.0 + extra, "decode_s": 0.5 + extra,
                "decode_steps": new_tokens - 1, "step_s": 0.5 / (new_tokens - 1),
                "forward": 0.9, "detokenize": 0.05, "host": 0.05}
    monkeypatch.setattr(ox, "_generate_run", fake_generate)
    monkeypatch.setattr(ox, "_engine_run", fake_engine)
    row = ox._timed_setting(None, [object(), object()], [[1, 2]] * 4, new_tokens=11,
                            rounds=3)
    assert calls == {"gen": 4, "eng": 2 + 2 * 3}  # one warm-up each, then 3 rounds
    assert row["generate_tok_s"] == pytest.approx(4 * 10 / 1.0)
    assert row["engine_tok_s"] == pytest.approx(4 * 10 / 0.5)
    assert row["engine_over_generate"] == pytest.approx(2.0)
    assert row["generate_compile_s"] == pytest.approx(10.0)
    assert row["engine_compile_s"] == pytest.approx(10.0)


@pytest.mark.slow  # ~45 s, as above
def test_long_context_benchmark(gguf, tmp_path):
    result = _run("experiments/serving/long_context.py:small", gguf, tmp_path,
                  "--config.contexts=(64,512)", "--config.batch=2", "--config.decode_steps=4",
                  "--config.block_size=8", "--config.prefill_chunk=32",
                  "--config.min_read_len=32", "--config.calibration_seqs=2",
                  "--config.memory_batch=2", "--config.memory_context=128",
                  "--config.max_budget_rows=3", "--config.budget_decode_steps=3",
                  "--config.quality.length=128", "--config.quality.continuation=32",
                  "--config.quality.offset=0")
    # the tiny model's 512 positions: a 512 context holds a 507-token prompt + 4 decoded
    assert sorted({(r["context"], r["prompt_tokens"]) for r in result["rows"]}) == [
        (64, 64), (512, 507)]
    rows = {r["codec"]: r for r in result["rows"] if r["context"] == 64}
    assert set(rows) == {"bf16", "int8", "tasq-1bit", "tasq-1bit-post-rope"}
    for r in rows.values():
        assert r["decode_tok_s"] > 0 and r["compiles_while_serving"] == 0
        assert r["seqs_at_budget"] == 3 and r["budget_tok_s"] > 0  # capped by the config
        assert r["cont_ppl"] > 1 and r["cont_tokens"] == 2 * 32
    assert len({r["cont_ppl"] for r in rows.values()}) == 4  # each codec changes quality
    assert rows["bf16"]["kv_bytes_per_token"] == 16 * rows["tasq-1bit"]["kv_bytes_per_token"]
    assert rows["tasq-1bit"]["kv_bytes_per_token"] * 15 <= rows["bf16"]["kv_bytes_per_token"]
    assert len(result["claims"]) == 2 * 2 + 2  # per TaSQ row at batch; at the budget, 512
    mem = result["extra"]["prefill_memory"]
    assert mem["chunked_bytes"] < mem["one_piece_bytes"]


@pytest.mark.slow  # ~1 min: the servax half of the long-context peer script (no peer in CI)
def test_peer_long_context_servax_half(gguf, tmp_path):
    result = _run("experiments/serving/peer_llamacpp_long.py:small", gguf, tmp_path,
                  "--config.llamacpp_kv=()", "--config.servax_kv=('bf16','int8')",
                  "--config.context=128", "--config.decode_steps=4",
                  "--config.block_size=8", "--config.prefill_chunk=32",
                  "--config.min_read_len=32")
    rows = result["rows"]
    assert [(r["server"], r["kv"], r["prompt_tokens"]) for r in rows] == [
        ("servax", "bf16", 123), ("servax", "int8", 123)]
    assert all(r["decode_tok_s"] > 0 and len(r["tokens"]) == 4 for r in rows)
    # (the committed ledger may already count this run's item: "... re-scored (k)")
    assert result["claims"][0]["measured"].startswith("no peer row")
