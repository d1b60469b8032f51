"""notebooks/specscale.ipynb runs top to bottom."""
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "specscale.ipynb"


# slow: loads SmolLM2 and compiles its forward for several batch shapes (~2 min on CPU)
@pytest.mark.slow
def test_notebook_executes(monkeypatch):
    import os

    import nbformat
    # the kernel must import this checkout, not another servax on the path
    root = str(NOTEBOOK.parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    from nbclient import NotebookClient
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", []))
    assert "in use after freeing all: 0" in outputs
    assert "max |kernel - reference|" in outputs
