"""The specdecode notebook runs top to bottom (it loads SmolLM2 and compiles a few loops)."""
from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "specdecode.ipynb"


@pytest.mark.slow  # ~2 minutes: loads SmolLM2 and compiles several decode loops
def test_notebook_executes():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", []))
    assert "identical to plain greedy: True" in outputs
