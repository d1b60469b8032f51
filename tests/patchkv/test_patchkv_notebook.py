"""notebooks/patchkv.ipynb is what its generator writes (tests/test_notebooks.py runs it)."""
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "patchkv.ipynb"


def test_notebook_matches_its_generator(tmp_path):
    from experiments.patchkv import make_notebook
    make_notebook.write(tmp_path / "nb.ipynb")
    fresh = nbformat.read(tmp_path / "nb.ipynb", as_version=4)
    stored = nbformat.read(NOTEBOOK, as_version=4)
    assert [c.source for c in fresh.cells] == [c.source for c in stored.cells]
