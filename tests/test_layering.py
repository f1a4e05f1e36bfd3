"""The package layering of DESIGN.md, stated once here and enforced over every file of the project.

Rules (a layer may import only the layers in its row; third-party and standard-library imports are free,
except that the jax-free layers never import jax, jaxlib or grpc):

=============  ==========================================  =========================================
layer          files                                       may import
=============  ==========================================  =========================================
``ir``         ``ir/``                                     ``ir``
``fluid``      ``flotilla/fluid/`` (the Fluid front end),  ``ir``
               less its bridges ``io``,
               ``transpiler`` and ``incubate``
``passes``     ``passes/``                                 ``ir``
``transpiler`` ``transpiler/``                             ``ir``, ``passes``
``runtime``    ``runtime/``                                ``ir``
``flotilla``   the rest of ``flotilla/`` (user-facing)     everything
=============  ==========================================  =========================================

Every layer may import itself. The jax-free layers are ``ir``, ``fluid``, ``passes`` and ``transpiler``.
Every import counts, at top level or inside a function (a lazy import is still a dependency). Besides:
a pass module (one that defines a ``Pass``) imports no other pass module, only the shared modules of
``passes/``; and no two files import each other, directly or around a cycle.

Checks: a static one over the source (ast), and a dynamic one: in a fresh interpreter whose import system
refuses jax, jaxlib, grpc and runtime, every module of each jax-free layer imports.
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib
import subprocess
import sys
import textwrap

import networkx as nx
import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECT_PACKAGES = ("ir", "passes", "transpiler", "runtime", "flotilla")
EVERYTHING = frozenset({"ir", "fluid", "passes", "transpiler", "runtime", "flotilla"})

# layer -> the layers it may import (itself included)
RULES: dict[str, frozenset[str]] = {
    "ir": frozenset({"ir"}),
    "fluid": frozenset({"fluid", "ir"}),
    "passes": frozenset({"passes", "ir"}),
    "transpiler": frozenset({"transpiler", "passes", "ir"}),
    "runtime": frozenset({"runtime", "ir"}),
    "flotilla": EVERYTHING,
}
JAX_FREE = ("ir", "fluid", "passes", "transpiler")
HEAVY = ("jax", "jaxlib", "grpc")
FORBIDDEN_IN_JAX_FREE_INTERPRETER = HEAVY + ("runtime",)
# Modules of flotilla/fluid/ that bind the façade to the runtime and the transpiler: user-facing, not front end.
# (``flotilla.fluid.io`` re-exports runtime functions too, but loads them on first use: it is front end.)
FLUID_BRIDGES = ("flotilla.fluid.transpiler", "flotilla.fluid.incubate")



def layer_of(module: str) -> str | None:
    """The layer of a dotted module name; None for anything outside the project."""
    top = module.split(".")[0]
    if top not in PROJECT_PACKAGES:
        return None
    if module == "flotilla.fluid" or module.startswith("flotilla.fluid."):
        if not any(module == b or module.startswith(b + ".") for b in FLUID_BRIDGES):
            return "fluid"
    return top


# --- reading the source ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str  # dotted module name of the importing file
    module: str  # dotted name imported (``from a.b import c`` is ``a.b.c`` when that is a module file)
    where: str  # file:line
    lazy: bool  # inside a function body: runs only when called

    def __str__(self) -> str:
        return f"{self.where}: {self.importer} imports {self.module}" + (" (lazily)" if self.lazy else "")


def module_name(path: pathlib.Path, root: pathlib.Path = REPO_ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_files(root: pathlib.Path = REPO_ROOT) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the project's packages."""
    return {module_name(p, root): p for package in PROJECT_PACKAGES for p in sorted((root / package).rglob("*.py"))}


def imports_in(source: str, filename: str, importer: str, is_package: bool,
               modules: set[str] | frozenset[str] = frozenset()) -> list[Import]:
    """Every import statement of ``source``, anywhere (class bodies, ``if``/``try``, function bodies).

    Relative imports are made absolute; ``from P import n`` names ``P.n`` when that is one of ``modules``.
    """
    tree = ast.parse(source, filename=filename)
    found: list[Import] = []
    package = importer if is_package else importer.rpartition(".")[0]

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            where = f"{filename}:{getattr(child, 'lineno', 0)}"
            if isinstance(child, ast.Import):
                found.extend(Import(importer, alias.name, where, inner) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package
                    for _ in range(child.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = ".".join(p for p in (anchor, child.module) if p)
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    found.append(Import(importer, full if full in modules else base, where, inner))
            visit(child, inner)

    visit(tree, False)
    return found


def all_imports(root: pathlib.Path = REPO_ROOT) -> list[Import]:
    files = project_files(root)
    names = set(files)
    found: list[Import] = []
    for name, path in files.items():
        found += imports_in(path.read_text(encoding="utf-8"), str(path.relative_to(root)), name,
                            path.name == "__init__.py", names)
    return found


def rule_breaks(imports: list[Import], layer: str) -> list[str]:
    """The imports of files in ``layer`` that its row of RULES does not allow (and, for a jax-free layer,
    any import of jax, jaxlib or grpc)."""
    allowed = RULES[layer]
    problems = []
    for imp in imports:
        if layer_of(imp.importer) != layer:
            continue
        target = layer_of(imp.module)
        if target is not None and target not in allowed:
            problems.append(f"{imp} (layer {target}; {layer} may import only {', '.join(sorted(allowed))})")
        if layer in JAX_FREE and imp.module.split(".")[0] in HEAVY:
            problems.append(f"{imp} ({layer} is jax-free)")
    return problems


def pass_modules(files: dict[str, pathlib.Path]) -> set[str]:
    """The modules of ``passes/`` that define a ``Pass`` subclass."""
    found = set()
    for name, path in files.items():
        if layer_of(name) != "passes":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and any(
                    (b.id if isinstance(b, ast.Name) else getattr(b, "attr", None)) == "Pass" for b in node.bases):
                found.add(name)
    return found


def import_graph(imports: list[Import], files: set[str], lazy: bool) -> nx.DiGraph:
    """Files as nodes, one edge per import of another project file (the lazy ones only when ``lazy``)."""
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for imp in imports:
        if imp.lazy and not lazy:
            continue
        target = imp.module
        while target and target not in files:
            target = target.rpartition(".")[0]
        if target and target != imp.importer:
            graph.add_edge(imp.importer, target)
    return graph


# --- the checkers can fail ------------------------------------------------------------------------------


def test_static_reader_finds_every_import() -> None:
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
        from . import sibling
        from ..ir import core
        """
    )
    found = imports_in(source, "m.py", "passes.sub.m", False, {"runtime.launch", "passes.sub.sibling"})
    assert [(i.module, i.where, i.lazy) for i in found] == [
        ("os", "m.py:2", False), ("jax.numpy", "m.py:3", False), ("grpc", "m.py:5", False),
        ("runtime.executor", "m.py:9", False), ("runtime.launch", "m.py:11", True),
        ("passes.sub.sibling", "m.py:12", False), ("passes.ir", "m.py:13", False),
    ]
    problems = rule_breaks(found, "passes")
    assert [p.split(" (")[0] for p in problems] == [
        "m.py:3: passes.sub.m imports jax.numpy", "m.py:5: passes.sub.m imports grpc",
        "m.py:9: passes.sub.m imports runtime.executor", "m.py:11: passes.sub.m imports runtime.launch",
    ]


def test_layers_of_module_names() -> None:
    assert layer_of("ir.core") == "ir" and layer_of("passes") == "passes"
    assert layer_of("flotilla.fluid") == "fluid" and layer_of("flotilla.fluid.layers") == "fluid"
    assert layer_of("flotilla.fluid.io") == "fluid" and layer_of("flotilla.fluid.transpiler") == "flotilla"
    assert layer_of("flotilla.cli") == "flotilla"
    assert layer_of("numpy") is None and layer_of("jax") is None
    assert set(RULES) == EVERYTHING and set(JAX_FREE) < set(RULES)
    for layer, allowed in RULES.items():
        assert layer in allowed and allowed <= EVERYTHING
        assert "flotilla" not in allowed or layer == "flotilla"  # only the user-facing package imports it


def test_cycle_finder_finds_cycles() -> None:
    imports = [Import("a", "b", "a.py:1", False), Import("b", "c.x", "b.py:1", True), Import("c", "a", "c.py:1", False)]
    assert list(nx.simple_cycles(import_graph(imports, {"a", "b", "c"}, lazy=False))) == []
    assert sorted(next(iter(nx.simple_cycles(import_graph(imports, {"a", "b", "c"}, lazy=True))))) == ["a", "b", "c"]


# --- the rules ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    found = all_imports()
    assert len({i.importer for i in found}) >= 100, "the scan read too few files; is it reading the tree?"
    return found


@pytest.mark.parametrize("layer", [
    "ir", "fluid", "passes", "transpiler", "runtime", "flotilla",
])
def test_layer_imports_only_what_its_rule_allows(imports: list[Import], layer: str) -> None:
    assert any(layer_of(i.importer) == layer for i in imports), f"no file of layer {layer}"
    problems = rule_breaks(imports, layer)
    assert problems == [], "\n".join(problems)


#: The modules of ``passes/`` that define no pass: what several passes share, and what a pass may import.
SHARED_PASS_MODULES = frozenset({"passes.pass_base", "passes.dist_plan", "passes.collective_plan", "passes.liveness",
                                 "passes.rpc_builders", "passes.optimizer_ops", "passes.memory_report"})


def test_every_passes_module_is_a_pass_or_shared() -> None:
    """A new module of ``passes/`` either defines a pass or is listed in SHARED_PASS_MODULES (and defines none)."""
    files = project_files()
    modules = {name for name in files if layer_of(name) == "passes" and name != "passes"}
    passes = pass_modules(files)
    assert len(passes) >= 10
    assert modules - passes == SHARED_PASS_MODULES


def test_no_pass_module_imports_a_sibling_pass(imports: list[Import]) -> None:
    passes = pass_modules(project_files())
    problems = [f"{i} (a pass module: move what both need into a shared module)"
                for i in imports if i.importer in passes | SHARED_PASS_MODULES and i.module in passes
                and i.module != i.importer]
    assert problems == [], "\n".join(problems)


# Program.__str__ prints through the printer, which reads the core's classes: the one way back is the
# import inside __str__/__repr__, never at import time.
ALLOWED_LAZY_CYCLES = {frozenset({"ir.core", "ir.printer"})}


def test_no_import_cycle_between_files(imports: list[Import]) -> None:
    files = set(project_files())
    at_import = list(nx.simple_cycles(import_graph(imports, files, lazy=False)))
    assert at_import == [], "import cycles:\n" + "\n".join(" -> ".join(c + c[:1]) for c in at_import)
    with_lazy = [c for c in nx.simple_cycles(import_graph(imports, files, lazy=True))
                 if frozenset(c) not in ALLOWED_LAZY_CYCLES]
    assert with_lazy == [], "import cycles through lazy imports:\n" + "\n".join(" -> ".join(c + c[:1])
                                                                               for c in with_lazy)


# --- jax-free, at run time --------------------------------------------------------------------------------

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

    imported = []
    for module_name in {modules!r}:
        importlib.import_module(module_name)
        imported.append(module_name)
    for package_name in {packages!r}:
        package = importlib.import_module(package_name)
        for info in pkgutil.walk_packages(package.__path__, package_name + "."):
            if not any(info.name == s or info.name.startswith(s + ".") for s in {skip!r}):
                importlib.import_module(info.name)
                imported.append(info.name)
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)
    print("leaked:", leaked)
    print("imported:", " ".join(sorted(imported)))
    """
)

# layer -> (packages walked whole, modules imported one by one, modules skipped)
JAX_FREE_MODULES: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "ir": (("ir",), (), ()),
    "fluid": (("flotilla.fluid",), (), FLUID_BRIDGES),
    "passes": (("passes",), (), ()),
    "transpiler": (("transpiler",), (), ()),
    # not a jax-free layer, but inspecting programs must not start jax: its commands import runtime lazily
    "cli": ((), ("flotilla.cli",), ()),
}


def _run_blocked(forbidden: tuple[str, ...], packages: tuple[str, ...] = (), modules: tuple[str, ...] = (),
                 skip: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    script = _BLOCKED_IMPORT_SCRIPT.format(forbidden=forbidden, packages=packages, modules=modules, skip=skip)
    return subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("layer", ["ir", "fluid", "passes", "transpiler", "cli"])
def test_jax_free_layer_imports_without_jax_or_grpc(layer: str) -> None:
    packages, modules, skip = JAX_FREE_MODULES[layer]
    done = _run_blocked(FORBIDDEN_IN_JAX_FREE_INTERPRETER, packages, modules, skip)
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(":", 1) for line in done.stdout.splitlines())
    assert lines["leaked"].strip() == "[]"
    imported = lines["imported"].split()
    expected = {
        "ir": ("ir.core", "ir.printer", "ir.parser", "ir.serialize", "ir.verify", "ir.diff"),
        "fluid": ("flotilla.fluid.layers", "flotilla.fluid.optimizer"),
        "passes": ("passes.pass_base", "passes.trainer_send_recv"),
        "transpiler": ("transpiler.distribute_transpiler", "transpiler.plan"),
        "cli": ("flotilla.cli",),
    }[layer]
    for module in expected:
        assert module in imported


def test_jax_free_layers_are_all_checked() -> None:
    assert set(JAX_FREE) <= set(JAX_FREE_MODULES)


def test_blocking_finder_really_blocks() -> None:
    """The dynamic check can fail: importing a forbidden module under the finder is an ImportError."""
    done = _run_blocked(("json",))
    assert done.returncode == 0  # nothing imported json
    done = _run_blocked(("json",), modules=("json",))
    assert done.returncode != 0
    assert "layering test: importing 'json'" in done.stderr
