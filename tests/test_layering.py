"""The package layering of DESIGN.md: ``ir/``, ``passes/`` and ``transpiler/`` work without jax or grpc.

Two checks: a dynamic one (in a fresh interpreter whose import system refuses jax, jaxlib, grpc and
runtime, every module of the three packages imports) and a static one (no module of ``ir/`` or
``passes/`` imports them anywhere, and no module of ``transpiler/`` imports them at top level; the CLI
may import ``runtime`` lazily inside the commands that run programs).
"""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
FORBIDDEN = ("jax", "jaxlib", "grpc", "runtime")
LIGHT_PACKAGES = ("ir", "passes", "transpiler")

_BLOCKED_IMPORT_SCRIPT = textwrap.dedent(
    """
    import importlib
    import pkgutil
    import sys

    FORBIDDEN = {forbidden!r}

    class RefuseHeavyImports:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in FORBIDDEN:
                raise ImportError(f"layering test: importing {{name!r}} is not allowed here")
            return None

    sys.meta_path.insert(0, RefuseHeavyImports())

    import ir, passes, transpiler, flotilla.cli  # noqa: E401

    imported = []
    for package_name in {packages!r}:
        package = importlib.import_module(package_name)
        for info in pkgutil.walk_packages(package.__path__, package_name + "."):
            importlib.import_module(info.name)
            imported.append(info.name)
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)
    print("leaked:", leaked)
    print("imported:", " ".join(sorted(imported)))
    """
)


def _run_blocked(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def test_light_packages_import_without_jax_or_grpc() -> None:
    script = _BLOCKED_IMPORT_SCRIPT.format(forbidden=FORBIDDEN, packages=LIGHT_PACKAGES)
    done = _run_blocked(script)
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(":", 1) for line in done.stdout.splitlines())
    assert lines["leaked"].strip() == "[]"
    imported = lines["imported"].split()
    for module in ("transpiler.plan", "ir.diff", "ir.core", "ir.printer", "ir.parser", "ir.serialize", "ir.verify"):
        assert module in imported


def test_blocking_finder_really_blocks() -> None:
    """The dynamic check can fail: importing a forbidden module under the finder is an ImportError."""
    script = _BLOCKED_IMPORT_SCRIPT.format(forbidden=("json",), packages=())
    done = _run_blocked(script)
    assert done.returncode != 0
    assert "layering test: importing 'json'" in done.stderr


def forbidden_imports(source: str, filename: str, top_level_only: bool) -> list[str]:
    """``file:line: import X`` for each import of a FORBIDDEN package in ``source``.

    With ``top_level_only``, imports inside function bodies are allowed (they run only when called);
    imports in class bodies and under top-level ``if``/``try`` still count, since they run at import.
    """
    tree = ast.parse(source, filename=filename)
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if top_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [child.module]
            else:
                names = []
            for name in names:
                if name.split(".")[0] in FORBIDDEN:
                    found.append(f"{filename}:{child.lineno}: import {name}")
            visit(child)

    visit(tree)
    return found


def test_static_checker_finds_imports() -> None:
    source = textwrap.dedent(
        """
        import os
        import jax.numpy as jnp
        try:
            from grpc import aio
        except ImportError:
            aio = None
        class K:
            import runtime.executor
        def run():
            from runtime import launch
        """
    )
    assert forbidden_imports(source, "m.py", top_level_only=True) == [
        "m.py:3: import jax.numpy", "m.py:5: import grpc", "m.py:9: import runtime.executor",
    ]
    assert forbidden_imports(source, "m.py", top_level_only=False)[-1] == "m.py:11: import runtime"


def test_no_heavy_imports_in_light_packages() -> None:
    problems: list[str] = []
    checked = 0
    for package in LIGHT_PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(REPO_ROOT))
            # transpiler/ (the CLI) may import runtime lazily inside a command; ir/ and passes/ never.
            top_level_only = package == "transpiler"
            problems += forbidden_imports(path.read_text(encoding="utf-8"), rel, top_level_only)
            checked += 1
    assert checked >= 10
    assert problems == [], "\n".join(problems)
