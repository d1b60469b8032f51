"""experiments/serving/long_context_quality.py: its windows and passkey items, and the run
end to end on a tiny GGUF model (every codec row measured; the reference against itself
has KL 0; a test run declares its windows and passkey prompts to the item ledger)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from experiments import common
from experiments.serving import long_context_quality as cfg
from experiments.serving import long_context_quality_experiment as lcq
from research.model import init_params, tiny_config
from tests.model.gguf_writer import byte_vocab, write_llama_gguf

ROOT = Path(__file__).resolve().parents[2]


def test_config_and_windows():
    c = cfg.get_config("small")
    assert c.lengths == (2048, 4096, 8192) and c.windows >= 16 and c.passkey.trials >= 50
    assert c.codecs == cfg.DEFAULT_CODECS and c.reference == "bf16" and c.split == "test"
    with pytest.raises(ValueError, match="smoke"):
        cfg.get_config("huge")
    ids = np.arange(100)
    wins, starts = lcq.spread_windows(ids, 4, 40)
    assert starts.tolist() == [0, 20, 40, 60] and (wins[3] == np.arange(60, 100)).all()
    wins, starts = lcq.spread_windows(ids, 2, 150)  # longer than the text: read cyclically
    assert starts.tolist() == [0, 50] and (wins[1, :60] == np.r_[50:100, 0:10]).all()
    with pytest.raises(ValueError, match="windows"):
        lcq.spread_windows(ids, 0, 40)
    assert lcq.passkey_length(8192, 8192, 8) == 8184 == lcq.passkey_length(9000, 8192, 8)
    assert lcq.passkey_length(2048, 8192, 8) == 2048


def test_no_passkey_trials_is_a_quality_only_run():
    tok = common.tokenizer_only(None)
    config = cfg.get_config("smoke")
    config.split, config.lengths = "dev", (600,)
    config.passkey.trials = 0
    ((wins, starts, trials),) = lcq.run_items(tok, config, 8192).values()
    assert wins.shape == (2, 600) and trials == []
    config.passkey.trials = -1
    with pytest.raises(ValueError, match="passkey.trials"):
        lcq.run_items(tok, config, 8192)
    config.windows, config.passkey.trials = 0, 0
    with pytest.raises(ValueError, match="not both 0"):  # a run that scores nothing
        lcq.run_items(tok, config, 8192)


def test_no_windows_is_a_passkey_only_run():
    tok = common.tokenizer_only(None)
    config = cfg.get_config("smoke")
    config.split, config.lengths, config.windows = "dev", (600,), 0
    ((wins, starts, trials),) = lcq.run_items(tok, config, 8192).values()
    assert wins.shape == (0, 600) and starts.shape == (0,) and len(trials) == 4
    config.windows = -1
    with pytest.raises(ValueError, match="windows must be >= 0"):
        lcq.run_items(tok, config, 8192)


def test_exact_part_ablation_labels_every_codec_and_counts_its_bytes(tiny):
    from experiments.serving.long_context_experiment import block_bytes
    from research.serving import kv_codecs
    int8 = kv_codecs.codec_model(tiny, "int8")
    for part in ("k", "v"):
        ((name, model),) = lcq.exact_part_models({"int8": int8}, part).items()
        assert name == f"int8 ({part.upper()} bf16)" and f"{part}-bf16" in model.tags
        # the bfloat16 part's bytes are counted on top of the int8 records
        per_token = tiny.config.n_layers * tiny.config.n_kv_heads * tiny.config.head_dim * 2
        assert block_bytes(model, 16) == block_bytes(int8, 16) + 16 * per_token
    assert cfg.get_config("small").exact_part == ""  # the served codecs by default


@pytest.mark.slow  # ~1-2 min on 2 cores: three codecs, two lengths, through experiments.run
def test_long_context_quality_runs_end_to_end(tmp_path):
    config = tiny_config(vocab_size=len(byte_vocab()[0]), head_dim=16, max_position=512)
    gguf = write_llama_gguf(tmp_path / "tiny.gguf", config,
                            init_params(config, jax.random.key(0)))
    cmd = [sys.executable, "-m", "experiments.run",
           "--config=experiments/serving/long_context_quality.py:smoke",
           f"--workdir={tmp_path / 'w'}", f"--config.gguf_path={gguf}",
           "--config.lengths=(320,480)", "--config.windows=2", "--config.continuation=32",
           "--config.chunk=64", "--config.passkey.trials=3", "--config.passkey.batch=2",
           "--config.passkey.max_new_tokens=4", "--config.calibration_seqs=2",
           "--config.codecs=('bf16','int8','tasq-1bit')"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "w" / "serving_long_context_quality_smoke"
                         / "results.json").read_text())
    rows = {(r["length"], r["codec"]): r for r in result["rows"]}
    assert set(rows) == {(n, c) for n in (320, 480) for c in ("bf16", "int8", "tasq-1bit")}
    for (length, codec), r in rows.items():
        assert r["kl_tokens"] == 2 * 32 and r["ppl"] > 1 and r["ref_ppl"] > 1
        assert 0 <= r["passkey_acc"] <= 1 and r["passkey_tokens"] <= min(length, 508)
        if codec == "bf16":  # the reference itself
            assert r["kl"] == pytest.approx(0, abs=1e-7) and r["top1"] == 1
        else:
            assert r["kl"] > 0
    assert rows[(480, "tasq-1bit")]["kv_bytes_per_token"] < rows[(480, "int8")][
        "kv_bytes_per_token"] < rows[(480, "bf16")]["kv_bytes_per_token"]
    items = result["protocol"]["items"]
    assert items["items_total"] == 2 * (2 + 3)  # per length: windows + passkey prompts
    assert len(result["extra"]["passkey_trials"]["int8@480"]) == 3
