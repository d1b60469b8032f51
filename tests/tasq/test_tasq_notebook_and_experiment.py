"""The TaSQ experiment config and the notebook (executed with nbclient: slow)."""
from pathlib import Path

import pytest

from experiments.tasq import tasq as tasq_config

ROOT = Path(__file__).resolve().parents[2]


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
                   "TaSQ - head normalization"):
        assert needed in names


@pytest.mark.slow  # loads SmolLM2 and calibrates it inside a kernel: ~2 minutes
def test_notebook_runs():
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(ROOT / "notebooks" / "tasq.ipynb", as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    outputs = "".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                      for o in cell.get("outputs", []))
    assert "max |logit difference|" in outputs and "ValueError:" in outputs
