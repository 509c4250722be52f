"""The package's modules import each other without circles.

An import circle makes a module's names depend on which module of the circle is imported
first, and keeps the modules from being understood (or split) one at a time. Every
import counts, wherever it is written: at the top, inside a function, or under
``if TYPE_CHECKING:``. A function-local import only hides a circle from the interpreter,
not from the reader.

The graph: one node per module of ``aiopipe/`` (a package is its ``__init__``). ``import
a.b`` is an edge to ``a.b``; ``from a import b`` is an edge to ``a.b`` when that is a
module, else to ``a`` (the name is defined in ``a``'s ``__init__``). Importing a module does
import its parent packages too, but that is no edge here: a package's ``__init__`` may
import its submodules as long as none of them imports the ``__init__`` back.
"""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "aiopipe"

#: module -> {imported module: where (``path:line``) the first such import is}
Graph = dict[str, dict[str, str]]


def _module_names(root: Path) -> dict[str, Path]:
    """Every module under ``root`` (a package directory), by dotted name."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
              known: Mapping[str, Path]) -> Iterator[str]:
    """The modules of ``known`` that one import statement of ``module`` imports."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name in known:
                yield alias.name
        return
    if node.level:
        # a package resolves ``.`` to itself, a module to the package holding it
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join([*base, *([node.module] if node.module else [])])
    else:
        source = node.module or ""
    for alias in node.names:
        submodule = f"{source}.{alias.name}"
        if submodule in known:
            yield submodule
        elif source in known:
            yield source


def import_graph(root: Path = PACKAGE) -> Graph:
    """The import edges between the modules under ``root`` (self-imports left out)."""
    known = _module_names(root)
    graph: Graph = {}
    for module, path in known.items():
        edges = graph.setdefault(module, {})
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _imported(node, module, path.name == "__init__.py", known):
                if target != module:
                    where = f"{path.relative_to(root.parent)}:{node.lineno}"
                    edges.setdefault(target, where)
    return graph


def strongly_connected(graph: Mapping[str, Mapping[str, str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` with more than one module
    (a self-import is no edge of it), each sorted, in sorted order. Iterative: a long
    import chain does not reach the recursion limit."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, {})))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def shortest_cycle(graph: Mapping[str, Mapping[str, str]], start: str,
                   within: set[str]) -> list[str]:
    """The shortest cycle from ``start`` back to it through modules of ``within`` (its
    strongly connected component), as the modules in order, ``start`` first and last."""
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for successor in sorted(graph[node]):
            if successor not in within:
                continue
            if successor == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if successor not in came_from:
                came_from[successor] = node
                queue.append(successor)
    raise AssertionError(f"{start} is in no cycle within {sorted(within)}")


def cycles(graph: Mapping[str, Mapping[str, str]]) -> list[list[str]]:
    """One shortest cycle through each module that is in any cycle, without repeats,
    each starting from its first module in sort order."""
    found: list[list[str]] = []
    for component in strongly_connected(graph):
        for start in component:
            cycle = shortest_cycle(graph, start, set(component))[:-1]
            first = cycle.index(min(cycle))
            cycle = [*cycle[first:], *cycle[:first], min(cycle)]
            if cycle not in found:
                found.append(cycle)
    return found


def describe(graph: Mapping[str, Mapping[str, str]], cycle: Sequence[str]) -> str:
    """A cycle as its modules in order, each step with the line that imports."""
    steps = [f"{a} -> {b} ({graph[a][b]})" for a, b in itertools.pairwise(cycle)]
    return " -> ".join(cycle) + "\n    " + "\n    ".join(steps)


def test_the_package_has_no_import_cycles() -> None:
    graph = import_graph()
    found = cycles(graph)
    assert not found, f"{len(found)} import cycle(s):\n" + "\n".join(
        describe(graph, cycle) for cycle in found)


# -- the checker itself, on small made-up packages ----------------------------------------


def _package(root: Path, files: Mapping[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root / "pkg"


def test_every_kind_of_import_is_an_edge(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "pkg/__init__.py": "from pkg.a import thing\nfrom pkg import b\n",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from pkg.sub.c import C\n",
        "pkg/b.py": "def f():\n    import pkg.sub.c\n    from . import a\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from .. import name\nfrom ..a import x\nfrom . import d\n"
                        "import os\nfrom pkg.sub.d import y\n",
        "pkg/sub/d.py": "from .c import z\n",
    })
    assert {module: set(edges) for module, edges in import_graph(root).items()} == {
        "pkg": {"pkg.a", "pkg.b"},
        "pkg.a": {"pkg.sub.c"},
        "pkg.b": {"pkg.sub.c", "pkg.a"},
        "pkg.sub": set(),
        "pkg.sub.c": {"pkg", "pkg.a", "pkg.sub.d"},
        "pkg.sub.d": {"pkg.sub.c"},
    }
    assert import_graph(root)["pkg.a"]["pkg.sub.c"] == "pkg/a.py:3"


def test_cycles_are_found_and_named_in_order(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "pkg/__init__.py": "from pkg.a import thing\n",
        "pkg/a.py": "from pkg.b import thing\n",
        "pkg/b.py": "def f():\n    from pkg import thing\n",
        "pkg/c.py": "from pkg.d import thing\n",
        "pkg/d.py": "from pkg.c import thing\nfrom pkg.d import self_import\n",
        "pkg/e.py": "from pkg.a import thing\n",
    })
    graph = import_graph(root)
    assert cycles(graph) == [["pkg", "pkg.a", "pkg.b", "pkg"], ["pkg.c", "pkg.d", "pkg.c"]]
    assert describe(graph, ["pkg.c", "pkg.d", "pkg.c"]) == (
        "pkg.c -> pkg.d -> pkg.c\n"
        "    pkg.c -> pkg.d (pkg/c.py:1)\n"
        "    pkg.d -> pkg.c (pkg/d.py:1)")


def test_a_component_with_two_cycles_reports_both() -> None:
    graph = {"a": {"b": "", "c": ""}, "b": {"a": ""}, "c": {"a": ""}, "d": {"a": ""}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert cycles(graph) == [["a", "b", "a"], ["a", "c", "a"]]


#: Imports every module first, each in a fresh import state (torch stays loaded).
_EACH_FIRST = """
import importlib, sys
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "aiopipe" or m.startswith("aiopipe.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed.append(f"{name}: {exc!r}")
print("\\n".join(failed))
"""


@pytest.mark.slow
def test_every_module_imports_first() -> None:
    """Each module can be the first one imported: parent packages run at import time,
    so a package ``__init__`` that imports back into a module importing it fails at run
    time although the graph above (which leaves those edges out) has no cycle."""
    names = sorted(_module_names(PACKAGE))
    done = subprocess.run([sys.executable, "-c", _EACH_FIRST, *names], capture_output=True,
                          text=True, check=True, timeout=300)
    assert done.stdout.strip() == "", done.stdout
