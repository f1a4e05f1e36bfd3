"""A pass module is not a toolbox: no module defining a pass imports another one.

What several passes need lives in the shared modules listed here (or in ``ir``), so a pass can be read,
moved or dropped without the others. Checked statically, from the source.
"""
from __future__ import annotations

import ast
import pathlib

PASSES = pathlib.Path(__file__).resolve().parents[2] / "passes"

#: The modules of ``passes/`` that define no pass and that pass modules may import.
SHARED = {"pass_base", "dist_plan", "collective_plan", "liveness", "rpc_builders", "optimizer_ops", "memory_report"}


def _tree(module: str) -> ast.Module:
    return ast.parse((PASSES / f"{module}.py").read_text(), filename=f"passes/{module}.py")


def _defines_pass(tree: ast.Module) -> bool:
    """A class deriving from ``Pass`` (by name, as ``passes.pass_base.Pass`` is imported)."""
    return any(isinstance(node, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id == "Pass" or
                                                      isinstance(b, ast.Attribute) and b.attr == "Pass"
                                                      for b in node.bases)
               for node in ast.walk(tree))


def _passes_imports(tree: ast.Module) -> set[str]:
    """The modules of ``passes`` that ``tree`` imports (``passes.x``, ``from passes.x``, ``from passes import x``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("passes."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("passes."):
                out.add(node.module.split(".")[1])
            elif node.module == "passes":
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            out.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
    return out


MODULES = sorted(p.stem for p in PASSES.glob("*.py") if p.stem != "__init__")
PASS_MODULES = sorted(m for m in MODULES if _defines_pass(_tree(m)))


def test_every_module_is_a_pass_or_shared() -> None:
    """A new module of ``passes/`` must either define a pass or be listed in SHARED (and define none)."""
    assert PASS_MODULES, "found no pass module: the check is looking in the wrong place"
    assert sorted(set(MODULES) - set(PASS_MODULES)) == sorted(SHARED)


def test_no_pass_module_imports_another() -> None:
    offending = {}
    for module in PASS_MODULES:
        imported = _passes_imports(_tree(module)) - {module}
        if imported - SHARED:
            offending[module] = sorted(imported - SHARED)
    assert not offending, f"pass modules import other pass modules (move the helper to a shared module): {offending}"


def test_shared_modules_import_no_pass_module() -> None:
    offending = {m: sorted(_passes_imports(_tree(m)) - SHARED) for m in SHARED}
    assert not {m: v for m, v in offending.items() if v}, offending
