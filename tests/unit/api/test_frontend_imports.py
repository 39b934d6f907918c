"""A front-end process of `meshserve serve` (api/api_server_main.py) imports no torch.

It parses requests, tokenizes, detokenizes and frames responses; the model runs in the engine's
process. torch would cost each of the --api-server-count processes ~260 MB and about a second
of start-up (bench/frontend_process.py). What it imports is read from its own source (every
import statement in api_server_main.py, those inside main() included), then imported in a fresh
interpreter; a failure names the import chain that reached torch. (The live processes are checked
too: tests/integration/test_api_server_count.py reads their memory maps after serving.)
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import meshserve.api.api_server_main as api_server_main
from tests.serve_process import ROOT

# Run in a fresh interpreter: import each module given, note the meshserve frames that asked for torch.
PROBE = r"""
import importlib, importlib.abc, json, sys, traceback

chains = []

class Witness(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            chains.append([f"{f.filename.rsplit('/meshserve/', 1)[-1]}:{f.lineno}"
                           for f in traceback.extract_stack() if "/meshserve/" in f.filename])
        return None

sys.meta_path.insert(0, Witness())
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps({"torch": "torch" in sys.modules, "chains": chains}))
"""


def frontend_modules() -> list[str]:
    """Every module api_server_main.py imports, at its top or inside its functions."""
    tree = ast.parse(open(api_server_main.__file__).read())
    names = {api_server_main.__name__}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return sorted(names)


def test_the_front_end_process_imports_no_torch():
    modules = frontend_modules()
    assert {"meshserve.api.engine_client", "meshserve.api.serve"} <= set(modules), modules
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", PROBE, *modules], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert not got["torch"], f"torch imported by the front-end, through: {got['chains']}"
