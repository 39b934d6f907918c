"""Every module of meshserve/ is reached from an entry point, not only from tests: the package,
the `meshserve` console script, and the `python -m meshserve...` commands the Makefile runs.

Reached means imported (at module level, inside a function, or under TYPE_CHECKING) or named
in a string a lazy loader imports ("meshserve.x.y" or "meshserve.x.y:Name": the model and
backend tables, worker classes, rank processes started with -m). Read with `ast`, nothing runs.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "meshserve"
MODULE_NAME = re.compile(r"^meshserve(\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?$")
# Test-only today and on their way out (issue 36: KV transfer helpers serving never reaches);
# remove an entry once its module is gone or served.
PENDING = {"meshserve.kvtransfer.connector", "meshserve.kvtransfer.dist_transport"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    def resolve(target: str) -> str:
        while target and target not in mods:
            target = target.rpartition(".")[0]
        return target

    edges: dict[str, set[str]] = {}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        out = {".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)}  # its packages load first
        for node in ast.walk(ast.parse(p.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: pkg.count(".") + 2 - node.level]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_NAME.match(node.value):
                targets = [node.value.partition(":")[0]]
            out |= {r for r in map(resolve, targets) if r and r != m}
        edges[m] = out
    return edges


def _entry_points() -> set[str]:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"].values()
    make = re.findall(r"-m (meshserve[\w.]*)", (ROOT / "Makefile").read_text())
    return {"meshserve", *(s.partition(":")[0] for s in scripts), *make}


def _reached(edges: dict[str, set[str]], roots: set[str]) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo += edges.get(v, ())
    return seen


def test_every_module_is_reached_from_an_entry_point():
    mods = _modules()
    roots = _entry_points()
    assert {"meshserve.cli", "meshserve.api.protogen"} <= roots and roots <= set(mods)
    unreached = set(mods) - _reached(_edges(mods), roots)
    assert unreached <= PENDING, f"reached only by tests (or nothing): {sorted(unreached - PENDING)}"


def test_the_walk_follows_lazy_imports_and_module_strings():
    edges = _edges(_modules())
    assert "meshserve.workers.models.deepseek" in edges["meshserve.workers.models"]  # MODEL_CLASSES string
    assert _reached({"a": {"b"}, "b": {"c"}, "d": {"a"}}, {"a"}) == {"a", "b", "c"}
