"""The import graph of moesq_core and moesq_cli: no circles, the formats are the ground floor, and the rooms
(below) stand on at most MAX_FLOORS floors.

The library has three wings along the checkpoint: compression (moesq_core.compression: pipeline, engine, work
dir, calibration, methods, refinement's kernels, export), formats (numerics and layouts, importing nothing
outside moesq_core.formats) and serving (moesq_core.serving: experts modules, kernels, loader, generate, the
kernel benchmark); shared rooms (checkpoint, models, eval, naming, paths, memory, progress, version,
triton_support) sit between them.

The graph is read from the source with `ast`, not by importing anything:
- a node is a module, i.e. one .py file; a package's __init__.py is the node named after the package
  (`moesq_core.formats`), a directory without __init__.py (a namespace package) is no node;
- an edge is an `import` or `from ... import` statement anywhere in the file — module level or inside a function
  or class (a function-local import is a dependency that only waits to run) — except under `if TYPE_CHECKING:`;
  relative imports are resolved against the importing module's package;
- `import a.b.c` and `from a.b.c import name` are edges to `a.b.c`; `from a.b import c` is an edge to the
  submodule `a.b.c` when that file exists, else to the package `a.b`;
- importing `a.b.c` is NOT an edge to its parent packages `a` and `a.b`, although Python runs their __init__
  first: a module depends on what it names, and a package's __init__ (e.g. moesq_core's lazy API exports) sits
  above its submodules, not beside them;
- `importlib.import_module` with a computed name (the format registry, the lazy package attributes) is no edge;
- only modules of this repository are nodes; imports of anything else are dropped.
A circle is a strongly connected component of more than one node.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("moesq_core", "moesq_cli")
WINGS = ("compression", "serving")
MAX_FLOORS = 8


def module_files() -> dict[str, Path]:
    """Every module of PACKAGES by dotted name (a package's __init__.py under the package's name)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """The import statements of `tree` at any depth, skipping the bodies of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def imports_of(name: str, is_package: bool, source: str, modules) -> dict[str, int]:
    """The modules of `modules` that module `name` (its `source`) imports, each with the line of its first import."""
    package = name if is_package else name.rpartition(".")[0]
    out: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        if target in modules and target != name:  # `from . import name` in an __init__ names itself: no edge
            out.setdefault(target, line)

    for node in _import_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
            continue
        if node.level:
            base = package.split(".")
            base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            add(sub if sub in modules else source, node.lineno)
    return out


def import_graph() -> dict[str, dict[str, int]]:
    modules = module_files()
    return {name: imports_of(name, path.name == "__init__.py", path.read_text(), modules)
            for name, path in modules.items()}


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of `graph` with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def describe(component: list[str], graph: dict[str, dict[str, int]], modules: dict[str, Path]) -> str:
    """A circle's edges inside its component, as 'a -> b (path:line)' lines."""
    members = set(component)
    lines = [f"circle of {len(component)}: {', '.join(component)}"]
    for a in component:
        for b, line in sorted(graph[a].items()):
            if b in members:
                lines.append(f"  {a} -> {b} ({modules[a].relative_to(REPO)}:{line})")
    return "\n".join(lines)


def test_graph_reads_function_local_and_relative_imports():
    """The reader sees what the circles hide behind: function-local imports, `from pkg import submodule`,
    relative imports; and skips `if TYPE_CHECKING:`."""
    graph = import_graph()
    assert "moesq_core.compression.pipeline" in graph["moesq_core"]  # imported inside moesq_core.__getattr__
    assert "moesq_core.formats.registry" in graph["moesq_core.formats"]
    assert "moesq_core" not in graph["moesq_core.compression.pipeline"]  # parents are no edges
    modules = {"p", "p.a", "p.b", "p.c", "p.d", "p.e", "p.q", "p.q.m", "p.q.x", "p.q.y"}
    source = (
        "import typing\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from . import x\n    from ..a import thing\n"
        "if typing.TYPE_CHECKING:\n    import p.e\nelse:\n    import p.d\n"
        "def f():\n    from ..b import thing\n    from . import y, other\n"
        "class C:\n    def g(self):\n        from .. import c\n        import os, p.q.m\n")
    assert imports_of("p.q.m", False, source, modules) == {"p.d": 9, "p.b": 11, "p.q.y": 12, "p.q": 12, "p.c": 15}
    assert imports_of("p.q", True, "from . import x", modules) == {"p.q.x": 1}  # an __init__ is its package
    assert imports_of("p.a", False, "from . import c", modules) == {"p.c": 1}
    assert circles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}) == [["a", "b", "c"]]
    assert circles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_circles():
    modules = module_files()
    graph = import_graph()
    found = circles(graph)
    report = "\n".join(describe(c, graph, modules) for c in found)
    print(report)
    assert not found, f"{len(found)} import circle(s):\n{report}"


def room(module: str) -> str:
    """The room a module belongs to: a wing's module or subpackage (moesq_core.serving.kernels), another
    moesq_core package or module (moesq_core.formats, moesq_core.naming), moesq_core itself, or moesq_cli."""
    parts = module.split(".")
    if parts[0] != "moesq_core" or len(parts) == 1:
        return parts[0]
    return ".".join(parts[:3] if parts[1] in WINGS and len(parts) > 2 else parts[:2])


def room_graph(graph: dict[str, dict[str, int]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for a, targets in graph.items():
        rooms.setdefault(room(a), set())
        for b in targets:
            if room(a) != room(b):
                rooms[room(a)].add(room(b))
    return rooms


def floors(rooms: dict[str, set[str]]) -> dict[str, int]:
    """Each room's floor: 1 + the highest floor of the rooms it imports (1: it imports none). Needs no circles."""
    out: dict[str, int] = {}

    def floor(r: str) -> int:
        if r not in out:
            out[r] = 1 + max((floor(x) for x in rooms[r]), default=0)
        return out[r]

    for r in rooms:
        floor(r)
    return out


def test_room_floors_on_examples():
    assert room("moesq_core.serving.kernels.p48_mma") == "moesq_core.serving.kernels"
    assert room("moesq_core.compression.pipeline") == "moesq_core.compression.pipeline"
    assert room("moesq_core.formats.base") == "moesq_core.formats"
    assert room("moesq_core") == "moesq_core" and room("moesq_cli.app") == "moesq_cli"
    assert floors({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == {"a": 3, "b": 2, "c": 1}


def test_rooms_have_no_circles_and_at_most_max_floors():
    rooms = room_graph(import_graph())
    assert not circles({r: dict.fromkeys(t, 0) for r, t in rooms.items()})
    high = floors(rooms)
    top = max(high.values())
    assert top <= MAX_FLOORS, "\n".join(f"{f} {r}" for r, f in sorted(high.items(), key=lambda x: x[1]))


def test_formats_import_only_the_formats():
    """The ground floor: nothing of the wings, the checkpoint, models, eval, or even the shared utilities."""
    out = {(a, b) for a, targets in import_graph().items() if room(a) == "moesq_core.formats"
           for b in targets if room(b) != "moesq_core.formats"}
    assert not out, sorted(out)


def test_compression_and_serving_do_not_import_each_other_in_circles():
    """Serving never imports the compression wing (a pack loads without it); compression uses only the
    reference experts module of serving (the module a compressed block runs as)."""
    graph = import_graph()
    serving_to_compression = {(a, b) for a, t in graph.items() if a.startswith("moesq_core.serving")
                              for b in t if b.startswith("moesq_core.compression")}
    assert not serving_to_compression, sorted(serving_to_compression)
    compression_to_serving = {b for a, t in graph.items() if a.startswith("moesq_core.compression")
                              for b in t if b.startswith("moesq_core.serving")}
    assert compression_to_serving <= {"moesq_core.serving.experts"}, sorted(compression_to_serving)


if __name__ == "__main__":  # print today's circles
    _m, _g = module_files(), import_graph()
    for _c in circles(_g):
        print(describe(_c, _g, _m))
    _rooms = room_graph(_g)
    for _r, _f in sorted(floors(_rooms).items(), key=lambda x: x[1]):
        print(_f, _r, sorted(_rooms[_r]))
    pytest.main([__file__, "-q"])
