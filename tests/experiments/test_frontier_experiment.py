"""experiments/serving/frontier.py: the codec frontier end to end on a tiny GGUF model
(every codec row has bytes, quality, passkey and speed; the reference against itself has
KL 0; its items are the quality suite's), and the budget step's linear extrapolation."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from experiments.serving import frontier as cfg
from experiments.serving import frontier_experiment as fe
from experiments.serving import long_context_quality_experiment as lcq
from research.model import init_params, tiny_config
from tests.model.gguf_writer import byte_vocab, write_llama_gguf

ROOT = Path(__file__).resolve().parents[2]


def test_config():
    c = cfg.get_config("small")
    assert c.context == 8192 and c.lengths == (8192,) and c.reference == "bf16"
    assert set(c.codecs) >= {"bf16", "fp8", "int8", "int4", "kivi-2bit+w128", "tasq-2bit",
                             "tasq-1bit", "tasq-1bit+w128", "tasq-1bit-post",
                             "tasq-1bit-post+w128"}
    assert c.budget_probe_rows > c.batch and fe.test_items is lcq.test_items
    with pytest.raises(ValueError, match="smoke"):
        cfg.get_config("full")


def test_frontier_runs_end_to_end(tmp_path):
    config = tiny_config(vocab_size=len(byte_vocab()[0]), head_dim=16, max_position=512)
    gguf = write_llama_gguf(tmp_path / "tiny.gguf", config,
                            init_params(config, jax.random.key(0)))
    cmd = [sys.executable, "-m", "experiments.run",
           "--config=experiments/serving/frontier.py:smoke", f"--workdir={tmp_path / 'w'}",
           f"--config.gguf_path={gguf}", "--config.context=320", "--config.lengths=(320,)",
           "--config.continuation=32", "--config.passkey.trials=2",
           "--config.passkey.tail=16", "--config.passkey.max_new_tokens=4",
           "--config.batch=2", "--config.budget_probe_rows=3", "--config.decode_steps=2",
           "--config.budget_gib=0.001", "--config.calibration_seqs=2",
           "--config.codecs=('bf16','int8','tasq-1bit-post+w128')"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "w" / "serving_frontier_smoke" / "results.json")
                        .read_text())
    rows = {r["codec"]: r for r in result["rows"]}
    assert set(rows) == {"bf16", "int8", "tasq-1bit-post+w128"}
    for codec, r in rows.items():
        assert r["ppl"] > 1 and r["ref_ppl"] == rows["bf16"]["ppl"]
        assert 0 <= r["passkey_acc"] <= 1 and r["passkey_trials"] == 2
        assert r["decode_tok_s"] > 0 and r["budget_tok_s"] > 0 and r["seqs_at_budget"] > 0
        assert r["budget_modeled"] == (r["seqs_at_budget"] > 3)
    assert rows["bf16"]["kl"] == pytest.approx(0, abs=1e-7) and rows["bf16"]["top1"] == 1
    assert rows["int8"]["kl"] > 0 and rows["bf16"]["decode_vs_bf16"] == 1
    assert (rows["tasq-1bit-post+w128"]["kv_bytes_per_token"]
            < rows["int8"]["kv_bytes_per_token"] < rows["bf16"]["kv_bytes_per_token"])
    assert result["protocol"]["items"]["items_total"] == 1 + 2  # a window, two prompts


def test_budget_step_extrapolates_the_measured_line():
    assert fe.step_at_rows(10, (4, 0.4), (16, 1.0)) == 1.0  # within the probe: measured
    assert fe.step_at_rows(40, (4, 0.4), (16, 1.0)) == pytest.approx(0.4 + 36 * 0.05)
    with pytest.raises(ValueError, match="rows"):
        fe.step_at_rows(40, (16, 0.4), (16, 1.0))
    assert fe.step_at_rows(40, (4, 0.5), (16, 0.4)) == 0.4  # noise: no negative slope


def test_without_speed_the_rows_keep_quality_and_leave_speed_empty(tmp_path):
    config = tiny_config(vocab_size=len(byte_vocab()[0]), head_dim=16, max_position=512)
    gguf = write_llama_gguf(tmp_path / "tiny.gguf", config,
                            init_params(config, jax.random.key(0)))
    c = cfg.get_config("smoke")
    c.gguf_path, c.context, c.lengths, c.continuation = str(gguf), 160, (160,), 16
    c.passkey.trials, c.measure_speed, c.codecs = 0, False, ("bf16", "int8")
    report = fe.run(c, tmp_path)
    rows = {r["codec"]: r for r in report.rows}
    assert rows["int8"]["kl"] > 0 and rows["bf16"]["kl"] == pytest.approx(0, abs=1e-7)
    assert all(r[k] is None for r in rows.values() for k in fe.SPEED_COLUMNS)
    assert rows["int8"]["decode_vs_bf16"] is None and "speed_s" not in report.extra["timings"]
    assert any("not measured" in n for n in report.notes)


def test_decode_step_fills_codes_with_random_bytes():
    """The timed step reads spread-out codes, not init_cache's zeros (one bin per head
    would time a chain of dependent adds); float pools and block tables are untouched."""
    import jax.numpy as jnp
    import numpy as np

    from experiments.serving.decode_step import random_codes
    states = {"k_codes": jnp.zeros((64, 16, 3, 8), jnp.uint8),
              "k_hi": jnp.zeros((64, 16, 3, 8), jnp.uint16),
              "block_table": jnp.arange(8, dtype=jnp.int32).reshape(2, 4)}
    filled = random_codes(states, seed=1)
    codes = np.asarray(filled["k_codes"])
    assert codes.dtype == np.uint8 and len(np.unique(codes)) == 256
    assert abs(np.bincount(codes.ravel(), minlength=256).max() / codes.size - 1 / 256) < 0.005
    assert not np.asarray(filled["k_hi"]).any()
    np.testing.assert_array_equal(filled["block_table"], states["block_table"])
    np.testing.assert_array_equal(random_codes(states, seed=1)["k_codes"], codes)
