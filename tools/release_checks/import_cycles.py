"""No import circles: within each package, the modules' imports form a graph without cycles.

An edge ``a -> b`` is any import of module ``b`` (or of a name from it) written in module ``a``
of the same package, at any depth: a function's own imports count, and so do those under
``if TYPE_CHECKING:``. Importing late or for types only hides a circle from the interpreter, not
from a reader: two modules that need each other are one concern or a missing third module.
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to the package
``pkg`` itself.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

from release_checks.workspace import ROOT, packages

__all__ = ["import_cycles", "import_graph", "main"]


def import_graph(source: Path, top: str) -> dict[str, set[str]]:
    """``{module: modules of the same package it imports}`` for the package ``top`` whose
    sources lie under ``source`` (the directory holding ``top/``)."""
    modules = {_module_name(p, source): p for p in sorted((source / top).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, package, modules):
                if target.split(".")[0] == top and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def _module_name(path: Path, source: Path) -> str:
    parts = path.relative_to(source).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def _targets(
    node: ast.Import | ast.ImportFrom, package: str, modules: dict[str, Path]
) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    base = node.module or ""
    if node.level:
        anchor = package.split(".")
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    for alias in node.names:
        candidate = f"{base}.{alias.name}"
        yield candidate if candidate in modules else base


def main(root: Path = ROOT) -> int:
    """Print every circle in every package; 1 when there is one."""
    found = 0
    for package in packages(root).values():
        source = root / package.path / "src"
        for cycle in import_cycles(import_graph(source, package.module)):
            found += 1
            print(f"{package.name}: import circle {' <-> '.join(cycle)}")
    print(f"import cycles: {found} circle(s) in {len(packages(root))} packages")
    return 1 if found else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main())
