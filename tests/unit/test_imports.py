"""Imports point down: no cycle between kvprobe modules, nor between its rooms (sub-packages).

Read with ``ast`` over every file under src/kvprobe, function-local imports included (a local
import that dodges a cycle is still a cycle), and so are ``importlib.import_module("kvprobe...")``
calls with a literal name (``kvprobe.__getattr__``'s lazy exports: ``kvprobe`` imports
``kvprobe.api`` that way, so a module that imports ``kvprobe`` itself closes a loop through the
API). ``from kvprobe.pkg import name`` counts as an import of the module ``kvprobe.pkg.name`` where
that is a module, else of the package ``kvprobe.pkg``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvprobe

SRC = Path(kvprobe.__file__).parent


def _import_module_target(node: ast.AST) -> str | None:
    """The module named by ``importlib.import_module("...")`` or ``import_module("...")`` with a
    string literal (a lazy export, as ``kvprobe.__getattr__`` makes), else None."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return None
    func = node.func
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module"
             and isinstance(func.value, ast.Name) and func.value.id == "importlib")
    return node.args[0].value if named or (isinstance(func, ast.Name) and func.id == "import_module") else None


def module_graph(src: Path = SRC, package: str = "kvprobe") -> dict[str, set[str]]:
    modules = {}
    for path in src.rglob("*.py"):
        parts = (package, *path.relative_to(src).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(package):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith(package)}
            elif (target := _import_module_target(node)) and target.startswith(package):
                deps.add(target)
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



def test_the_graph_sees_a_planted_importlib_cycle(tmp_path):
    """A package whose __init__ exports lazily through importlib, and a module below it that imports
    the package: the loop kvprobe.results once closed (results -> kvprobe -> api -> ... -> results),
    which the graph missed while it read only import statements."""
    pkg = tmp_path / "planted"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('def __getattr__(name):\n    import importlib\n\n'
                                     '    return getattr(importlib.import_module("planted.api"), name)\n')
    (pkg / "api.py").write_text("from planted import results\n")
    (pkg / "results.py").write_text("def write():\n    from planted import __version__\n")
    (pkg / "other.py").write_text('from importlib import import_module\n\nimport_module("planted.api")\n')
    graph = module_graph(pkg, "planted")
    assert graph == {"planted": {"planted.api"}, "planted.api": {"planted.results"},
                     "planted.results": {"planted"}, "planted.other": {"planted.api"}}
    assert cycles(graph) == [["planted", "planted.api", "planted.results"]]


def test_kvprobes_version_is_its_installed_metadatas():
    """results writes the installed metadata's version into every table (not kvprobe.__version__,
    which would import the package and its lazy API from below): the two must not drift."""
    from kvprobe.results import installed_version

    assert installed_version("kvprobe") == kvprobe.__version__


def test_no_module_past_400_lines():
    """Issue 51: a module that outgrows 400 lines is split along its seams (as reports/summary.py into
    reports/arms.py and reports/numbers.py, probes/knockout.py's hooks into probes/engine.py)."""
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}, long


# Test folders that are not one of src/kvprobe's rooms, and why.
ACROSS_ROOMS = {"unit": "the top-level modules (api, pipeline, policy, intervals, identity ...) and the project's own "
                        "checks (docs, imports, reference tables)",
                "real": "the bundled real models, through every room", "families": "every model family through the "
                "rooms' suites", "data": "reference tables and fixtures, no tests"}


def test_the_test_folders_mirror_src():
    """Issue 51: a room's tests are in the folder of its name (tests/editor, tests/composer, tests/executor ...)."""
    tests = Path(__file__).resolve().parents[1]
    rooms = {p.name for p in SRC.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert folders - rooms - set(ACROSS_ROOMS) == set(), folders - rooms - set(ACROSS_ROOMS)


def test_the_executor_runs_steps_and_knows_no_probe():
    """The generic executor (serial or Ray) runs any task; what a task keeps per process (the probes' caches
    of each case) is the task's own (probes.engine.pair_memo), not built by the executor (issue 51)."""
    graph = module_graph()
    above = {d for m, deps in graph.items() if room(m) == "kvprobe.executor" for d in deps
             if room(d) not in ("kvprobe.executor", "kvprobe.errors", "kvprobe.identity", "kvprobe.models")}
    assert above == set(), above
