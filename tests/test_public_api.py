"""Front doors: code reaches another package only through its public names.

* Nowhere in research/, experiments/, scripts/ or the notebooks does a module take an
  underscore-prefixed name (`from m import _x`, or `m._x` on an imported module) from a
  module of another package.
* Experiments and notebooks import a technique through its package (`from research.tasq
  import tasq`), never from one of its modules (`research.tasq.transform`).

Notebook code is checked twice: in the .ipynb files, and in their percent-format sources
(notebooks/src/*.py, from which scripts/make_notebooks.py generates them).
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TECHNIQUES = ("tasq", "patchkv", "eviction", "megaflux", "specscale", "specdecode", "moe",
              "sharding", "dynacore")
# Known violations another change is removing (each with who fixes it); the last test
# fails once one is gone, so the entry is dropped with the fix.
PENDING: dict[tuple[str, str], str] = {}


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _package(dotted: str) -> str:
    """The package a first-party module belongs to (a package is its own)."""
    path = ROOT.joinpath(*dotted.split("."))
    return dotted if (path / "__init__.py").is_file() else dotted.rpartition(".")[0]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def violations(source: str, module: str, front_doors_only: bool) -> list[str]:
    """What `source` (the code of `module`, dotted; "" for a notebook) does wrong."""
    tree = ast.parse(source)
    own = _package(module) if module else ""
    found, modules = [], {}  # local name -> imported first-party module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _is_module(a.name):
                    local = a.asname or a.name.split(".")[0]
                    modules[local] = a.name if a.asname else a.name.split(".")[0]
                    if front_doors_only:
                        found += _deep_import(a.name, node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not _is_module(node.module):
                continue
            if front_doors_only:
                found += _deep_import(node.module, node.lineno)
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if _is_module(full):
                    modules[a.asname or a.name] = full
                    if front_doors_only:
                        found += _deep_import(full, node.lineno)
                elif _private(a.name) and _package(node.module) != own:
                    found.append(f"line {node.lineno}: imports private {a.name} from "
                                 f"{node.module}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr)
                and isinstance(node.value, ast.Name) and node.value.id in modules
                and _package(modules[node.value.id]) != own):
            found.append(f"line {node.lineno}: uses private {modules[node.value.id]}."
                         f"{node.attr}")
    return found


def _deep_import(dotted: str, lineno: int) -> list[str]:
    """An import that goes past a technique's front door (research.<technique>.<module>)."""
    parts = dotted.split(".")
    if len(parts) > 2 and parts[0] == "research" and parts[1] in TECHNIQUES:
        return [f"line {lineno}: imports {dotted}; use the front door "
                f"research.{parts[1]}"]
    return []


def _notebook_code(cell_source: str) -> str:
    """A cell's Python (IPython magic and shell lines become `pass`)."""
    return "\n".join(line[:len(line) - len(line.lstrip())] + "pass"
                     if line.lstrip().startswith(("%", "!")) else line
                     for line in cell_source.splitlines())


def _sources():
    """(id, source, module, front_doors_only) for everything the rules cover."""
    for top in ("research", "experiments", "scripts"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" not in path.parts:
                yield (str(path.relative_to(ROOT)), path.read_text(), _module_name(path),
                       top == "experiments")
    for path in sorted((ROOT / "notebooks" / "src").glob("*.py")):
        yield (str(path.relative_to(ROOT)), path.read_text(), "", True)
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "code":
                yield (f"{path.relative_to(ROOT)}: cell {i}",
                       _notebook_code("".join(cell["source"])), "", True)


def _pending(where: str, violation: str) -> bool:
    return any(where == path and violation.endswith(name) for path, name in PENDING)


def test_nothing_reaches_past_a_front_door():
    bad = [f"{where}: {v}" for where, source, module, strict in _sources()
           for v in violations(source, module, strict) if not _pending(where, v)]
    assert not bad, "\n".join(bad)


def test_every_pending_violation_is_still_there():
    found = {(where, v) for where, source, module, strict in _sources()
             for v in violations(source, module, strict)}
    for path, name in PENDING:
        assert any(w == path and v.endswith(name) for w, v in found), (
            f"{path} no longer uses {name}: remove it from PENDING")


def test_the_scan_covers_notebook_sources_and_notebooks():
    where = [w for w, *_ in _sources()]
    assert "notebooks/src/patchkv.py" in where
    assert any(w.startswith("notebooks/patchkv.ipynb: cell") for w in where)


@pytest.mark.parametrize("source,module,strict,expected", [
    ("from research.model.llama import _block", "research.patchkv.patch", False,
     "imports private _block from research.model.llama"),
    ("from research.model import llama\nllama._block(1)", "research.patchkv.patch", False,
     "uses private research.model.llama._block"),
    ("import research.model.llama as L\nL._ffn", "experiments.baseline.experiment", False,
     "uses private research.model.llama._ffn"),
    ("from research.tasq.transform import tasq", "", True,
     "imports research.tasq.transform; use the front door research.tasq"),
    ("from research.patchkv import session", "experiments.patchkv.experiment", True,
     "imports research.patchkv.session; use the front door research.patchkv"),
])
def test_the_rules_catch(source, module, strict, expected):
    assert any(expected in v for v in violations(source, module, strict))


@pytest.mark.parametrize("source,module,strict", [
    ("from research.patchkv.patch import _valid_rows", "research.patchkv.baselines", False),
    ("from research.tasq import tasq\nfrom research.model.llama import Model", "", True),
    ("from research.tasq.transform import tasq", "research.patchkv.patch", False),
    ("from experiments.patchkv import experiment as ex\nex._calibration",
     "experiments.patchkv.patchkv", True),
])
def test_the_rules_allow(source, module, strict):
    assert violations(source, module, strict) == []
