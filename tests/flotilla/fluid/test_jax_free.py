"""The Fluid front end builds programs without jax: ``import flotilla.fluid`` and its builder modules load
only ``ir`` (the runtime and transpiler names of ``fluid`` import on first use)."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

FLUID = pathlib.Path(__file__).resolve().parents[3] / "flotilla" / "fluid"
# the façade submodules, which re-export the runtime and the transpiler; every other module is the builder
FACADES = {"io.py", "transpiler.py"}


def test_import_loads_no_runtime_jax_or_transpiler() -> None:
    builder = sorted(p.stem for p in FLUID.glob("*.py") if p.name not in FACADES | {"__init__.py"})
    script = ("import sys, flotilla.fluid as f\n"
              f"for m in {builder!r}: __import__('flotilla.fluid.' + m)\n"
              "f.layers.fc, f.ParamAttr, f.optimizer.SGD\n"
              "heavy = ('jax', 'jaxlib', 'grpc', 'runtime', 'transpiler', 'passes')\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=FLUID.parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_builder_modules_import_only_ir_and_each_other() -> None:
    project = {"ir", "passes", "transpiler", "runtime", "flotilla", "examples", "bench", "tests"}
    found = []
    for path in sorted(FLUID.glob("*.py")):
        if path.name in FACADES:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                     else [])
            for name in names:
                root = name.split(".")[0]
                if root in project and root != "ir" and not name.startswith("flotilla.fluid"):
                    found.append(f"{path.name}:{node.lineno}: import {name}")
    assert found == []
