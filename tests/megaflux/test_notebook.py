"""notebooks/megaflux.ipynb runs top to bottom (nbclient) and is in sync with its generator."""
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "megaflux.ipynb"


def test_notebook_matches_generator():
    from experiments.megaflux.make_notebook import CELLS
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert [c.source for c in nb.cells] == [c.source for c in CELLS], (
        "regenerate with: python -m experiments.megaflux.make_notebook")


# slow: a fresh kernel that imports JAX, compiles the layer and trains a tiny model
# (~1-2 minutes on a shared 2-core machine).
@pytest.mark.slow
def test_notebook_executes(monkeypatch):
    from nbclient import NotebookClient
    import os
    # the kernel must import this checkout, not another installed copy of servax
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", []))
    assert "8 devices" in outputs and "MegaFlux gamma" in outputs
