"""notebooks/patchkv.ipynb runs top to bottom and is what the generator writes."""
import os
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "patchkv.ipynb"


def test_notebook_matches_its_generator(tmp_path):
    from experiments.patchkv import make_notebook
    make_notebook.write(tmp_path / "nb.ipynb")
    fresh = nbformat.read(tmp_path / "nb.ipynb", as_version=4)
    stored = nbformat.read(NOTEBOOK, as_version=4)
    assert [c.source for c in fresh.cells] == [c.source for c in stored.cells]


@pytest.mark.slow  # real SmolLM2 load + one patch fit: ~2 min on a free 2-core CPU
def test_notebook_executes():
    from nbclient import NotebookClient
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env_path}" if env_path else str(ROOT)
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", []))
    assert "same shapes: True" in outputs and "PatchKV" in outputs
