"""The library's floors (DESIGN.md convention 15): the module import graph of research/
has no cycle, and nothing below research/serving imports it.

Every module under research/ is parsed with `ast` (nothing is imported); an edge
A -> B is any import of B in A, at the top or inside a function (a lazy import that
closes a circle is still a circle), except imports under `if TYPE_CHECKING:`.
`from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg`.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = "research"
TOP_FLOOR = "research.serving"  # the floor nothing else in research/ may import


def module_files(root: Path = ROOT, top: str = LIBRARY) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `top` (a package is its
    __init__)."""
    out = {}
    for path in sorted((root / top).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_free(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    return tree


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The deepest module of `modules` that `name` (dotted) is or lies in."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in modules:
            return candidate
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that `module` (at `path`) imports anywhere in its body."""
    tree = _type_checking_free(ast.parse(path.read_text(), filename=str(path)))
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1 more
                pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                pkg = pkg[:len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            r = _resolve(t, modules)
            if r is not None and r != module:
                out.add(r)
    return out


def import_graph(root: Path = ROOT, top: str = LIBRARY) -> dict[str, set[str]]:
    modules = module_files(root, top)
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle [a, b, ..., a], or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state and (cycle := visit(n)):
            return cycle
    return None


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_research_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle in research/: " + " -> ".join(cycle)


def test_nothing_below_serving_imports_it():
    graph = import_graph()
    offenders = sorted(f"{m} imports {t}" for m, deps in graph.items()
                       if not _inside(m, TOP_FLOOR) for t in deps if _inside(t, TOP_FLOOR))
    assert not offenders, ("research.serving is the top floor; below it: "
                           + "; ".join(offenders))


def test_the_checks_see_lazy_relative_and_cyclic_imports(tmp_path):
    pkg = tmp_path / "lib"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from lib.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from ..c import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    import lib.a\nimport lib.sub\n")
    graph = import_graph(tmp_path, "lib")
    assert graph["lib.a"] == {"lib.sub.b"}
    assert graph["lib.sub.b"] == {"lib.c"}
    assert graph["lib.c"] == {"lib.sub"}
    assert find_cycle(graph) is None
    (pkg / "c.py").write_text("import lib.a\n")
    assert find_cycle(import_graph(tmp_path, "lib")) == ["lib.a", "lib.sub.b", "lib.c",
                                                         "lib.a"]
