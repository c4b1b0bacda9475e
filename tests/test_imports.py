"""No import cycles among the project's own modules, read from the source with `ast`.

Two roots, each with its own module names: the `fastqwen` package (`fastqwen.synth`,
`fastqwen.judge.cli`, relative imports resolved against the importing package) and the
engine folder `engine/`, whose modules import each other by absolute name as the platform
loads them (`import fq_ops`, `from fqkernels.gemv import ...`, `from fqkernels import pdl`).
Every import statement counts, at module level or inside a function (a deferred import
hides a cycle from the interpreter, not from the reader). An import names the most
specific project module it reaches: `from a import b` is an edge to `a.b` when that is a
module, else to `a`. Imports of anything outside the root are ignored.

`python tests/test_imports.py` prints both graphs' cycles.
"""
from __future__ import annotations

import ast
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def module_names(src_root: pathlib.Path, package: str | None = None) -> dict[str, pathlib.Path]:
    """{dotted module name: file} for the .py files under `src_root` (under `src_root/package` when given).

    Names are relative to `src_root`; a package's `__init__.py` is named by its folder.
    """
    top = src_root / package if package else src_root
    names: dict[str, pathlib.Path] = {}
    for path in sorted(top.rglob("*.py")):
        parts = list(path.relative_to(src_root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts and all(p.isidentifier() for p in parts):
            names[".".join(parts)] = path
    return names


def _resolve(name: str, known: dict[str, pathlib.Path]) -> str | None:
    """The longest prefix of dotted `name` that is a known module, or None."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def imports_of(module: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The known modules that `module` (the file at `path`) imports, anywhere in its body."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".") if package else []
                keep = len(base_parts) - (node.level - 1)
                if keep < 0:
                    continue  # beyond the root: not one of ours
                base = ".".join(base_parts[:keep] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from a import b`: b is a submodule of a, or a name defined in a.
            targets = []
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                targets.append(sub if alias.name != "*" and sub in known else base)
        else:
            continue
        for target in targets:
            resolved = _resolve(target, known) if target else None
            if resolved is not None and resolved != module:
                found.add(resolved)
    return found


def import_graph(src_root: pathlib.Path, package: str | None = None) -> dict[str, set[str]]:
    """{module: modules it imports} for every module under the root (see `module_names`)."""
    known = module_names(src_root, package)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph`, each as [a, b, ..., a] starting from its smallest name.

    Tarjan's algorithm finds the strongly connected components; inside each one of more
    than one module, the shortest cycle through every member is reported (so a component
    of three modules that also holds a two-module loop names both).
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            components.append(component)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                strongconnect(v)
    finally:
        sys.setrecursionlimit(limit)

    cycles: set[tuple[str, ...]] = set()
    for component in components:
        if len(component) < 2:
            continue
        for start in sorted(component):
            cycle = _shortest_cycle(graph, component, start)
            first = cycle.index(min(cycle))  # one rotation per cycle
            cycles.add(tuple(cycle[first:] + cycle[:first]))
    return sorted([*c, c[0]] for c in cycles)


def _shortest_cycle(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """The shortest cycle through `start` inside its component (breadth-first), without the repeat."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier and start not in parent:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ()) & component):
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    path = [start]
    v = parent[start]
    while v != start:
        path.append(v)
        v = parent[v]
    return path[::-1]


def describe(cycles: list[list[str]]) -> str:
    return "; ".join(" -> ".join(c) for c in cycles)


def test_fastqwen_has_no_import_cycles():
    graph = import_graph(REPO, "fastqwen")
    assert "fastqwen.synth" in graph and "fastqwen.judge.cli" in graph  # the root is read
    cycles = find_cycles(graph)
    assert not cycles, f"import cycles in fastqwen/: {describe(cycles)}"


def test_engine_has_no_import_cycles():
    graph = import_graph(REPO / "engine")
    assert "engine" in graph and "fq_ops" in graph  # the root is read
    cycles = find_cycles(graph)
    assert not cycles, f"import cycles in engine/: {describe(cycles)}"


def test_cycle_finder_reports_a_planted_cycle(tmp_path: pathlib.Path):
    """a -> b -> a through a function-level relative import is reported; c's one-way import is not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n    return a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.c"] == {"pkg.a"}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert describe(find_cycles(graph)) == "pkg.a -> pkg.b -> pkg.a"


def test_cycle_finder_reads_engine_style_absolute_names(tmp_path: pathlib.Path):
    """Folder-root modules that import each other by bare name (`import k`, `from kern.x import f`)."""
    (tmp_path / "kern").mkdir()
    (tmp_path / "kern" / "__init__.py").write_text("")
    (tmp_path / "kern" / "x.py").write_text("import torch\nfrom kern import y\n")
    (tmp_path / "kern" / "y.py").write_text("def g():\n    from kern.x import f\n")
    (tmp_path / "top.py").write_text("import kern.x\nfrom kern.y import g\n")
    graph = import_graph(tmp_path)
    assert graph["top"] == {"kern.x", "kern.y"}
    assert find_cycles(graph) == [["kern.x", "kern.y", "kern.x"]]


if __name__ == "__main__":
    for label, graph in (("fastqwen", import_graph(REPO, "fastqwen")), ("engine", import_graph(REPO / "engine"))):
        print(f"{label}: {len(graph)} modules, cycles: {describe(find_cycles(graph)) or 'none'}")
