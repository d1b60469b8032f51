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
