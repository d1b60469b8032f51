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


def test_quickstart_is_generated_from_script():
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_notebooks
    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    sources = [c.source for c in nb.cells]
    assert sources == [c.source for c in make_notebooks.QUICKSTART]
