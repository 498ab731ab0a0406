"""Imports point down: no cycle between kvprobe modules, nor between its rooms (sub-packages).

Read with ``ast`` over every file under src/kvprobe, function-local imports included (a local
import that dodges a cycle is still a cycle). ``from kvprobe.pkg import name`` counts as an import
of the module ``kvprobe.pkg.name`` where that is a module, else of the package ``kvprobe.pkg``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvprobe

SRC = Path(kvprobe.__file__).parent


def module_graph() -> dict[str, set[str]]:
    modules = {}
    for path in SRC.rglob("*.py"):
        parts = ("kvprobe", *path.relative_to(SRC).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kvprobe"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("kvprobe")}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def room(module: str) -> str:
    """kvprobe.kv.cache -> kvprobe.kv; a top-level module is its own room."""
    return ".".join(module.split(".")[:2])


def test_no_module_imports_itself_in_a_cycle():
    assert cycles(module_graph()) == []


def test_no_cycle_between_rooms():
    rooms: dict[str, set[str]] = {}
    for mod, deps in module_graph().items():
        rooms.setdefault(room(mod), set()).update(room(d) for d in deps if room(d) != room(mod))
    assert cycles(rooms) == []


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]

