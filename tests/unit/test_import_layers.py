"""The import graph of meshserve points one way (DESIGN.md, Layout) and has no cycles.

Layers, highest first:  entry points (meshserve/__init__, cli, embed_cli)  ->  api  ->  cluster
->  engine  ->  {workers, kvtransfer}  ->  {parallel, kvstore, attention}  ->  core (core/, config.py,
errors.py, demo_model).
A module may import its own layer or any layer below it, never one above. Every module must
belong to a layer: a new top-level module fails here until LAYERS names its layer.

Which imports count (read with `ast`, nothing is executed):
- Direction: every import -- module level, inside functions, and under `if TYPE_CHECKING:`.
  DESIGN.md says "imports point downward only" with no exception for lazy imports, and it is
  right not to: a lazy import changes when a dependency loads, not whether it exists (workers/
  importing cluster/ inside a function still cannot run without cluster/ and Ray), and a
  type-only import is still knowledge of the layer above.
- Cycles, twice: among module-level imports that run (the import-time graph, where a cycle
  breaks on initialisation order), and among all imports (a cycle hidden behind a lazy or a
  type-only import is still two modules that cannot be read or changed apart).
- Third-party: attention/ and kvstore/ know nothing of Ray or gRPC; workers/ and parallel/ run
  without Ray (nor gRPC); core knows neither.

The shared checker tools/import_layers.py applies the same layers (it leaves out type-only
imports); this test is the one CI runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import meshserve

PACKAGE_DIR = Path(meshserve.__file__).resolve().parent

ENTRY, API, CLUSTER, ENGINE, WORKERS, LEAF, CORE = 6, 5, 4, 3, 2, 1, 0
LAYER_NAMES = {ENTRY: "entry points", API: "api", CLUSTER: "cluster", ENGINE: "engine", WORKERS: "workers/kvtransfer",
               LEAF: "parallel/kvstore/attention", CORE: "core"}
# The first name under meshserve/ decides a module's layer; `None` is meshserve/__init__ itself.
LAYERS: dict[str | None, int] = {
    None: ENTRY, "cli": ENTRY, "embed_cli": ENTRY,
    "api": API, "v1": API,  # v1: the generated gRPC stubs, used by api/ only
    "cluster": CLUSTER,
    "engine": ENGINE,
    "workers": WORKERS, "kvtransfer": WORKERS,
    "parallel": LEAF, "kvstore": LEAF, "attention": LEAF,
    "core": CORE, "config": CORE, "errors": CORE, "demo_model": CORE,
}
# Third-party packages a layer must not import (at any level).
FORBIDDEN_PACKAGES = {
    CORE: {"ray", "grpc"}, LEAF: {"ray", "grpc"}, WORKERS: {"ray", "grpc"}, ENGINE: {"ray", "grpc", "zmq"},
}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = ("meshserve",) + path.relative_to(PACKAGE_DIR).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1] if len(parts) > 1 else None)


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (imports that never run)."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for n in ast.walk(node) if n is not node.test)
    return inside


def _nearest_module(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """Absolute names one import statement loads: modules when they exist, else the package."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parent = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parent + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def _graph():
    """Per module: runtime module-level edges, all edges, third-party roots; edges as {target: line}."""
    top, every, external = {}, {}, {}
    for mod, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        type_only = _type_checking_nodes(tree)
        top[mod], every[mod], external[mod] = {}, {}, {}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in _targets(node, package):
                if not name.startswith("meshserve"):
                    external[mod].setdefault(name.split(".")[0], node.lineno)
                    continue
                target = _nearest_module(name)
                if target is None or target == mod:
                    continue
                every[mod].setdefault(target, node.lineno)
                if node in tree.body and id(node) not in type_only:
                    top[mod].setdefault(target, node.lineno)
    return top, every, external


TOP_EDGES, ALL_EDGES, EXTERNAL = _graph()


def _where(mod: str, line: int) -> str:
    path = MODULES[mod].relative_to(PACKAGE_DIR.parent) if mod in MODULES else mod
    return f"{path}:{line}"


def _cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """One concrete cycle (a path back to its start) per strongly connected component."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan; the graph is ~130 nodes, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    cycles = []
    for comp in comps:  # shortest path from the smallest member back to itself, inside the component
        start = min(comp)
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            nxt = sorted(w for w in edges[path[-1]] if w in comp)
            if start in nxt:
                cycles.append(path + [start])
                break
            for w in nxt:
                if w not in seen:
                    seen.add(w)
                    paths.append(path + [w])
    return cycles


def _describe(cycle: list[str], edges: dict[str, dict[str, int]]) -> str:
    return " -> ".join(cycle) + "  (" + ", ".join(_where(a, edges[a][b]) for a, b in zip(cycle, cycle[1:])) + ")"


def test_every_module_has_a_layer():
    homeless = sorted(m for m in MODULES if layer_of(m) is None)
    assert not homeless, f"modules in no layer (move them into one, or name their layer in LAYERS): {homeless}"


def upward_imports(edges: dict[str, dict[str, int]]) -> list[str]:
    upward = []
    for mod, targets in sorted(edges.items()):
        for target, line in sorted(targets.items()):
            src, dst = layer_of(mod), layer_of(target)
            if src is not None and dst is not None and dst > src:
                upward.append(f"{_where(mod, line)}: {mod} ({LAYER_NAMES[src]}) imports {target} "
                              f"({LAYER_NAMES[dst]})")
    return upward


def test_imports_point_downward():
    upward = upward_imports(ALL_EDGES)
    assert not upward, "imports pointing up the layers:\n" + "\n".join(upward)


def test_no_module_level_import_cycles():
    cycles = _cycles(TOP_EDGES)
    assert not cycles, "module-level import cycles:\n" + "\n".join(_describe(c, TOP_EDGES) for c in cycles)


def test_no_import_cycles_through_lazy_imports():
    cycles = _cycles(ALL_EDGES)
    assert not cycles, "import cycles (counting imports inside functions):\n" + "\n".join(
        _describe(c, ALL_EDGES) for c in cycles)


def test_lower_layers_know_nothing_of_ray_or_grpc():
    found = []
    for mod, packages in EXTERNAL.items():
        banned = FORBIDDEN_PACKAGES.get(layer_of(mod), set())
        found += [f"{_where(mod, line)}: {mod} imports {pkg}" for pkg, line in sorted(packages.items())
                  if pkg in banned]
    assert not found, "Ray / gRPC below cluster/:\n" + "\n".join(found)


def test_the_checker_sees_planted_problems():
    """The rules are only as good as the graph: planted edges must show, relative imports resolve."""
    planted = {"meshserve.workers.worker": {"meshserve.cluster.executors.rank_host": 7,
                                            "meshserve.kvstore.block_pool": 8}}
    assert upward_imports(planted) == ["meshserve/workers/worker.py:7: meshserve.workers.worker (workers/kvtransfer) "
                                       "imports meshserve.cluster.executors.rank_host (cluster)"]
    ring = {"a": {"b": 1}, "b": {"c": 2, "d": 5}, "c": {"a": 3}, "d": {}}
    assert _cycles(ring) == [["a", "b", "c", "a"]]
    relative = ast.parse("from .block_pool import BlockPool\nfrom ..errors import check\nfrom . import manager")
    package = "meshserve.kvstore"
    assert [t for node in relative.body for t in _targets(node, package)] == [
        "meshserve.kvstore.block_pool", "meshserve.errors", "meshserve.kvstore.manager"]
    assert "meshserve.errors" in TOP_EDGES["meshserve.config"]  # the graph is read at all
