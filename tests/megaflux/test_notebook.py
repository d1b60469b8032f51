"""notebooks/megaflux.ipynb is in sync with its generator (tests/test_notebooks.py runs it)."""
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "megaflux.ipynb"


def test_notebook_matches_generator():
    from experiments.megaflux.make_notebook import CELLS
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert [c.source for c in nb.cells] == [c.source for c in CELLS], (
        "regenerate with: python -m experiments.megaflux.make_notebook")
