"""The TaSQ experiment config (tests/test_notebooks.py executes notebooks/tasq.ipynb)."""
import pytest

from experiments.tasq import tasq as tasq_config


def test_experiment_configs():
    for arg in ("small", "full", "dev"):
        c = tasq_config.get_config(arg)
        assert c.experiment == "experiments.tasq.experiment" and c.run_name == f"tasq_{arg}"
        assert c.split == ("dev" if arg == "dev" else "test")
    with pytest.raises(ValueError, match="small"):
        tasq_config.get_config("huge")


def test_experiment_lists_every_baseline_and_ablation():
    from experiments.tasq.experiment import variants
    names = [n for n, _, _ in variants(tasq_config.get_config("full"))]
    for needed in ("f32", "bf16", "int8 per-token", "KIVI-2 (fp window)", "plain VQ",
                   "CQ-style (pre-RoPE)", "sign-bit (QJL-like keys)",
                   "TaSQ (1 bit, post-RoPE keys)", "TaSQ post-RoPE - query weighting",
                   "TaSQ post-RoPE - channel grouping", "TaSQ post-RoPE - head normalization",
                   "TaSQ (1 bit, pre-RoPE keys)", "TaSQ pre-RoPE - query weighting",
                   "TaSQ pre-RoPE - channel grouping", "TaSQ (2 bits)"):
        assert needed in names
    small = [n for n, _, _ in variants(tasq_config.get_config("small"))]
    assert set(small) == set(tasq_config.get_config("small").rows)
    # dev: only the key-space choice, scored on the dev half of the held-out text
    assert [n for n, _, _ in variants(tasq_config.get_config("dev"))] == [
        "f32", "TaSQ (1 bit, post-RoPE keys)", "TaSQ (1 bit, pre-RoPE keys)"]
    c = tasq_config.get_config("small")
    c.rows = ("TaSQ (3 bits)",)
    with pytest.raises(ValueError, match="unknown rows"):
        variants(c)


def test_default_key_space_is_the_dev_winner():
    """TaSQConfig's default is the key space with the smaller dev perplexity gap in the
    committed dev run (results/tasq_dev/)."""
    import json
    from pathlib import Path
    from experiments.tasq.experiment import KEY_SPACE_ROWS, default_row
    from research.tasq import TaSQConfig
    run = Path(__file__).resolve().parents[2] / "results" / "tasq_dev" / "results.json"
    rows = {r["codec"]: r["ppl gap %"] for r in json.loads(run.read_text())["rows"]}
    winner = min(KEY_SPACE_ROWS, key=lambda k: rows[KEY_SPACE_ROWS[k]])
    assert TaSQConfig().key_space == winner and default_row() == KEY_SPACE_ROWS[winner]


def test_time_decode_reports_every_code_reader():
    """The timing helper runs bf16, post-RoPE (LUT) and pre-RoPE (two-pass) reads and full
    decode steps side by side; keys as the report and plot use them."""
    import jax.numpy as jnp
    import numpy as np
    from experiments.tasq.experiment import TIMED, time_decode
    from research.tasq.cq import CQCodec
    from research.tasq.vq import VQCodec
    from research.model import tiny_config
    c = tiny_config()
    rng = np.random.default_rng(0)
    g = c.head_dim // 8
    book = lambda: rng.normal(size=(c.n_kv_heads, g, 256, 8)).astype(np.float32)  # noqa
    perm = jnp.asarray(np.stack([rng.permutation(c.head_dim) for _ in range(c.n_kv_heads)]))
    caches = {"1bit": VQCodec.create(book(), book()),
              "1bit_pre": CQCodec(book(), book(), key_perm=perm, value_perm=perm)}
    # jnp permutations closed over by the timed jit (as the experiment's calibrated caches)
    t = time_decode(caches, c, 64, batch=1, warmup=1, repeats=1, seed=0)
    for name, _, _ in TIMED:
        assert t[f"{name}_ms"] > 0 and t[f"{name}_step_ms"] > 0 and t[f"{name}_speedup"] > 0
    assert t["bf16_bytes"] == 16 * t["1bit_bytes"]  # 2 B/channel vs 1 bit/channel
