"""Every notebook executes top to bottom (the same public API the README shows)."""
from pathlib import Path

import nbclient
import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
FAST = {"quickstart.ipynb"}  # the others run in the slow suite


def _params():
    for nb in NOTEBOOKS:
        marks = () if nb.name in FAST else (pytest.mark.slow,)
        yield pytest.param(nb, id=nb.stem, marks=marks)


@pytest.mark.parametrize("path", list(_params()))
def test_notebook_executes(path):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_notebook_is_what_its_generator_writes(path):
    """Notebooks are generated (reviewable Python); a hand edit would be lost."""
    import importlib
    import sys
    if path.stem == "quickstart":
        sys.path.insert(0, str(ROOT / "scripts"))
        cells = importlib.import_module("make_notebooks").QUICKSTART
    else:
        cells = importlib.import_module(f"experiments.{path.stem}.make_notebook").CELLS
    stored = nbformat.read(path, as_version=4)
    assert [c.source for c in stored.cells] == [c.source for c in cells], (
        f"{path.name} differs from its generator; regenerate it")


def test_setup_cell_runs_in_a_jupyter_without_google():
    """Outside Colab there may be no `google` package at all, and then
    importlib.util.find_spec("google.colab") raises instead of returning None."""
    from nbformat.v4 import new_code_cell, new_notebook

    from experiments.notebook_cells import INSTALL
    nb = new_notebook(cells=[
        new_code_cell("import sys\nsys.modules['google'] = None  # no `google` package"),
        new_code_cell(INSTALL),
        new_code_cell("assert IN_COLAB is False\nimport research")])
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={
        "metadata": {"path": str(ROOT / "notebooks")}}).execute()
