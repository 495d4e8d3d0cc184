"""The import graph of a package's source, read with ast (nothing is imported): every import
statement counts, at module level, under TYPE_CHECKING or inside a function."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path


def module_name(path: Path, src_root: Path) -> str:
    parts = list(path.relative_to(src_root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package_dir: Path, src_root: Path) -> dict[str, Path]:
    """Every module of the package (sub-packages included) by dotted name."""
    return {module_name(path, src_root): path for path in sorted(package_dir.rglob("*.py"))}


def _imported(tree: ast.AST, here: str, is_package: bool) -> Iterator[tuple[str, list[str]]]:
    """(module, names) of each import statement, relative ones made absolute."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")
                anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            yield base, [alias.name for alias in node.names]


def import_graph(package_dir: Path, src_root: Path) -> dict[str, set[str]]:
    """Each module's imports of other modules of the same package (by dotted name)."""
    known = modules(package_dir, src_root)
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        targets: set[str] = set()
        for base, names in _imported(tree, name, path.name == "__init__.py"):
            submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in known]
            targets.update(submodules)
            if base in known and len(submodules) < len(names or [None]):
                targets.add(base)  # a name defined in the module (or package) itself
        graph[name] = targets - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None when the graph is a tree (acyclic)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        state[start] = 1
        path.append(start)
        while stack:
            node, targets = stack[-1]
            target = next(targets, None)
            if target is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state.get(target) == 1:
                return [*path[path.index(target):], target]
            elif not state.get(target):
                state[target] = 1
                path.append(target)
                stack.append((target, iter(sorted(graph.get(target, ())))))
    return None


def importers(graph: dict[str, set[str]], prefix: str) -> dict[str, set[str]]:
    """Who imports the modules under `prefix` (the prefix module itself included)."""
    found: dict[str, set[str]] = {}
    for source, targets in graph.items():
        hits = {t for t in targets if t == prefix or t.startswith(prefix + ".")}
        if hits:
            found[source] = hits
    return found


def imports_of(path: Path) -> set[str]:
    """Every module name one file imports, with the names it takes from it (`a.b`, `a.b.c`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for base, names in _imported(tree, "", False):
        found.add(base)
        found.update(f"{base}.{n}" for n in names)
    return found
