"""The TaSQ experiment config (tests/test_notebooks.py executes notebooks/tasq.ipynb)."""
import pytest

from experiments.tasq import tasq as tasq_config


def test_experiment_configs():
    for arg in ("small", "full"):
        c = tasq_config.get_config(arg)
        assert c.experiment == "experiments.tasq.experiment" and c.run_name == f"tasq_{arg}"
    with pytest.raises(ValueError, match="small"):
        tasq_config.get_config("huge")


def test_experiment_lists_every_baseline_and_ablation():
    from experiments.tasq.experiment import variants
    names = [n for n, _, _ in variants(tasq_config.get_config("small"))]
    for needed in ("f32", "bf16", "int8 per-token", "KIVI-2 (fp window)", "plain VQ",
                   "CQ-style (pre-RoPE)", "sign-bit (QJL-like keys)", "TaSQ (1 bit)",
                   "TaSQ - query weighting", "TaSQ - channel grouping",
                   "TaSQ - head normalization", "TaSQ (1 bit, pre-RoPE keys)",
                   "TaSQ pre-RoPE - query weighting", "TaSQ pre-RoPE - channel grouping"):
        assert needed in names


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
