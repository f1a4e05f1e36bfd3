"""Every error code names one exception class: a code is what tools, tests and users match on, so the
same code on two classes would make ``E...`` mean two different failures.

The check reads the source (ast over every ``.py`` file of the tree): a class body's ``code = "E..."``
gives the class its default code, and a call ``SomeError(..., code="E...")`` gives ``SomeError`` that
code for one raise. A class may own several codes (one per mistake); a code may not have two owners.
"""
from __future__ import annotations

import ast
import pathlib
import re
import textwrap
from collections import defaultdict

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
CODE = re.compile(r"E\d{3}")
SKIPPED_DIRS = {"build", "dist", "__pycache__", "venv"}  # and every hidden directory
BASE = "FlotillaError"


def _code_value(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and CODE.fullmatch(node.value):
        return node.value
    return None


def _callee_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [name for name in (_callee_name(b) for b in cls.bases) if name is not None]


def scan(source: str, filename: str) -> tuple[list[tuple[str, str, str]], dict[str, list[str]]]:
    """(code, owner, ``file:line``) for each code in ``source``, and each class's base-class names."""
    tree = ast.parse(source, filename=filename)
    found: list[tuple[str, str, str]] = []
    bases: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases[node.name] = _base_names(node)
            for stmt in node.body:
                if isinstance(stmt, ast.Assign):
                    targets, value = stmt.targets, stmt.value
                elif isinstance(stmt, ast.AnnAssign):
                    targets, value = [stmt.target], stmt.value
                else:
                    continue
                code = _code_value(value)
                if code and any(isinstance(t, ast.Name) and t.id == "code" for t in targets):
                    found.append((code, node.name, f"{filename}:{stmt.lineno}"))
        elif isinstance(node, ast.Call):
            for kw in node.keywords:
                code = _code_value(kw.value) if kw.arg == "code" else None
                owner = _callee_name(node.func)
                if code and owner:
                    found.append((code, owner, f"{filename}:{node.lineno}"))
    return found, bases


def _project_files() -> list[pathlib.Path]:
    def skipped(path: pathlib.Path) -> bool:
        return any(part in SKIPPED_DIRS or part.startswith(".") for part in path.relative_to(REPO_ROOT).parts[:-1])

    return sorted(p for p in REPO_ROOT.rglob("*.py") if not skipped(p))


def _tree_codes() -> tuple[list[tuple[str, str, str]], dict[str, list[str]]]:
    found: list[tuple[str, str, str]] = []
    bases: dict[str, list[str]] = {}
    for path in _project_files():
        rel = str(path.relative_to(REPO_ROOT))
        if rel.startswith("tests/"):
            continue  # tests raise and match codes; the classes that own them live in the project
        file_found, file_bases = scan(path.read_text(encoding="utf-8"), rel)
        found += file_found
        bases.update(file_bases)
    return found, bases


def owners_by_code(found: list[tuple[str, str, str]]) -> dict[str, dict[str, list[str]]]:
    by_code: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for code, owner, where in found:
        by_code[code][owner].append(where)
    return by_code


def _is_error_class(name: str, bases: dict[str, list[str]]) -> bool:
    seen: set[str] = set()
    todo = [name]
    while todo:
        current = todo.pop()
        if current == BASE:
            return True
        if current in seen:
            continue
        seen.add(current)
        todo += bases.get(current, [])
    return False


def test_scanner_finds_class_and_call_codes() -> None:
    source = textwrap.dedent(
        """
        class AError(FlotillaError):
            code = "E100"
        class BError(AError):
            code: str = "E101"
        def f():
            raise AError("x", code="E102")
        def g():
            return BError("y", hint="h", code="E100")
        other = dict(code="not a code")
        """
    )
    found, bases = scan(source, "m.py")
    assert found == [("E100", "AError", "m.py:3"), ("E101", "BError", "m.py:5"), ("E102", "AError", "m.py:7"),
                     ("E100", "BError", "m.py:9")]
    assert {c: sorted(o) for c, o in owners_by_code(found).items()} == {
        "E100": ["AError", "BError"], "E101": ["BError"], "E102": ["AError"]}
    assert _is_error_class("BError", bases) and not _is_error_class("dict", bases)


def test_every_code_belongs_to_exactly_one_exception_class() -> None:
    found, _ = _tree_codes()
    assert len({code for code, _, _ in found}) >= 50, "the scan found too few codes; is it reading the tree?"
    shared = [
        f"{code}: " + "; ".join(f"{owner} ({', '.join(where)})" for owner, where in sorted(owners.items()))
        for code, owners in sorted(owners_by_code(found).items()) if len(owners) > 1
    ]
    assert shared == [], "codes used by more than one exception class:\n" + "\n".join(shared)


def test_every_code_is_given_to_an_exception_class() -> None:
    """A ``code="E..."`` passed to a helper instead of the exception would hide the owner from the check."""
    found, bases = _tree_codes()
    not_errors = sorted({f"{owner} ({where})" for _, owner, where in found if not _is_error_class(owner, bases)})
    assert not_errors == [], "codes given to something that is not a FlotillaError subclass:\n" + "\n".join(not_errors)
