"""The parser of the canonical text form: ``parse_program(format_program(p))`` rebuilds ``p`` exactly.

It reads the grammar documented in ``ir.printer`` (one item a line, ``#`` comment lines)::

    program {random_seed=0}
    block 0 {
      var NAME : TYPE<DTYPE>[DIM, ...] {PROP=VALUE, ...}
      param NAME : TYPE<DTYPE>[DIM, ...] {PROP=VALUE, ...}
      op TYPE(SLOT=[NAME, ...], ...) -> (SLOT=[NAME, ...], ...) {ATTR=VALUE, ...}
    }
    block 1 parent 0 {
    }

Design and invariants:
- A hand-written lexer (one compiled regex applied along each line, never slicing the rest of the
  text) and a recursive-descent parser over each line's tokens: linear in the size of the text.
  Only ``\\n`` ends a line (JSON strings may hold U+2028 or U+0085 raw; they are not line breaks).
- Parsing checks syntax and names only: op types must be registered, and variable types, dtypes
  and property names must be known. Slots and attributes are taken as written (ops are built with
  ``Block._append_raw_op``, no inference runs): the verifier reports semantic problems.
- Variables are built as ``Variable``/``Parameter`` values and added with ``Block.add_var``; only the
  properties written are passed, so the dataclass defaults apply to the rest.
- Every error is an ``ir.errors.ParseError`` whose message reads ``FILE:LINE:COL: error: WHAT``
  followed by the source line and a caret under the column (1-based line and column); unknown names
  come with the closest known one (``did you mean 'send'?``). The error also carries ``filename``,
  ``line`` and ``col`` attributes.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import re
from typing import Any, NoReturn

from ir.core import Block, Parameter, Program, Variable
from ir.errors import IRError, ParseError
from ir.ops.registry import DTYPES, VAR_TYPES, BlockRef, all_op_defs, has_op, suggest

__all__ = ["parse_program", "parse_program_file"]

# One token, after optional blanks: a name, a number, a JSON string, '->', or any other single
# character (punctuation, or a stray character reported by the parser). Numbers are lexed greedily
# (any run of number characters) and validated afterwards, so ``1.2.3`` is one bad number.
# Tokens are plain strings, their kind told by the first character; columns are recomputed (by
# ``finditer`` over the same line) only when an error is reported.
_TOKEN_RE = re.compile(
    r"[ \t]*("
    r"[A-Za-z_@][A-Za-z0-9_@.\-]*"
    r"|-?[0-9][A-Za-z0-9_.+\-]*"
    r"|-?inf(?![A-Za-z0-9_@.\-])"
    r"|\"[^\"\\]*(?:\\.[^\"\\]*)*\""
    r"|->"
    r"|.)"
)
_INT_RE = re.compile(r"-?[0-9]+\Z")
_FLOAT_RE = re.compile(r"-?(?:[0-9]+\.[0-9]+(?:[eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+|inf)\Z")
_NAME_START = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_@")
_NUM_START = frozenset("0123456789-")
_PUNCT = frozenset({"{", "}", "(", ")", "[", "]", "=", ",", ":", "<", ">", "^", "->"})
_EOL = ""  # the token that ends every line's token list

_VALUE_WORDS = {"true": True, "false": False, "inf": math.inf, "nan": math.nan, "none": None}
_VALUE_EXPECTED = "a value (true, false, a number, a JSON string, ^N or a list)"
_HEADER_FIELDS = frozenset({"name", "shape", "dtype", "type"})
_BLOCK_ITEMS = ("var", "param", "op")
_PROGRAM_PROPS = ("random_seed",)


def _field_types(cls: type) -> dict[str, frozenset[str]]:
    """Property name → accepted Python type names, read from the dataclass annotations."""
    return {
        f.name: frozenset(part.strip() for part in str(f.type).split("|"))
        for f in dataclasses.fields(cls)
        if f.name not in _HEADER_FIELDS
    }


_VAR_PROPS = _field_types(Variable)
_PARAM_PROPS = _field_types(Parameter)


def _kind(tok: str) -> str:
    """``eol``, ``name``, ``str``, ``num``, ``punct`` or ``bad`` (a stray character)."""
    if not tok:
        return "eol"
    c = tok[0]
    if c in _NAME_START:
        return "name"
    if c == '"':
        return "str" if len(tok) > 1 else "bad"
    if tok in _PUNCT:
        return "punct"
    if c in _NUM_START and len(tok) > 1 or c.isdigit():
        return "num"
    return "bad"


def _describe(tok: str) -> str:
    kind = _kind(tok)
    if kind == "eol":
        return "end of line"
    if kind == "num":
        return f"number {tok}"
    if kind == "str":
        return f"string {tok}"
    if kind == "bad":
        return f"character {tok!r}"
    return f"'{tok}'"


def _type_name(value: Any) -> str:
    return "None" if value is None else type(value).__name__


def _with_hint(what: str, name: str, candidates: Any) -> str:
    hint = suggest(name, candidates)
    return f"{what} ({hint})" if hint else what


class _Parser:
    """Parses one text. The cursor is the current line (``line_no``, 1-based), its tokens
    ``toks`` (ending with ``_EOL``) and the index ``pos`` of the next token."""

    def __init__(self, text: str, filename: str) -> None:
        self.filename = filename
        self.lines = text.split("\n")
        self.line_no = 0
        self.toks: list[str] = [_EOL]
        self.pos = 0
        self.program = Program()

    # --- errors
    def error_at(self, line_no: int, col: int, what: str) -> NoReturn:
        """Raise a ParseError at 0-based column ``col`` of line ``line_no``."""
        source = self.lines[line_no - 1] if 0 < line_no <= len(self.lines) else ""
        # Keep tabs in the caret's indent so that it lines up under the column.
        indent = "".join(c if c == "\t" else " " for c in source[:col])
        err = ParseError(f"{self.filename}:{line_no}:{col + 1}: error: {what}\n{source}\n{indent}^")
        err.filename, err.line, err.col = self.filename, line_no, col + 1  # type: ignore[attr-defined]
        raise err

    def col_of(self, index: int) -> int:
        """0-based column of token ``index`` of the current line."""
        line = self.lines[self.line_no - 1]
        for i, m in enumerate(_TOKEN_RE.finditer(line)):
            if i == index:
                return m.start(1)
        return len(line)

    def error(self, index: int, what: str) -> NoReturn:
        self.error_at(self.line_no, self.col_of(index), what)

    def unexpected(self, index: int, expected: str, candidates: Any = ()) -> NoReturn:
        tok = self.toks[index]
        what = f"expected {expected}, found {_describe(tok)}"
        if tok == '"':
            what = "unterminated string: expected a closing '\"' on the same line"
        elif tok == "#":
            what += " (comments take a whole line that starts with '#')"
        elif candidates and _kind(tok) == "name":
            what = _with_hint(what, tok, candidates)
        self.error(index, what)

    # --- lexing
    def load_line(self, index: int) -> bool:
        """Tokenize line ``index`` (0-based); False for blank and comment lines."""
        line = self.lines[index]
        self.line_no = index + 1
        stripped = line.lstrip(" \t")
        if not stripped or stripped[0] == "#":
            return False
        self.toks = _TOKEN_RE.findall(line)
        self.toks.append(_EOL)
        self.pos = 0
        return True

    def expect(self, tok: str, expected: str) -> None:
        if self.toks[self.pos] != tok:
            self.unexpected(self.pos, expected)
        self.pos += 1

    def accept(self, tok: str) -> bool:
        if self.toks[self.pos] == tok:
            self.pos += 1
            return True
        return False

    def keyword(self, word: str, expected: str | None = None) -> None:
        if self.toks[self.pos] != word:
            self.unexpected(self.pos, expected or f"'{word}'", (word,))
        self.pos += 1

    def end_line(self, after: str) -> None:
        if self.toks[self.pos] != _EOL:
            self.unexpected(self.pos, f"end of line after {after}")

    # --- atoms
    def string(self, index: int) -> str:
        tok = self.toks[index]
        if "\\" not in tok:
            return tok[1:-1]
        try:
            return json.loads(tok)
        except json.JSONDecodeError as e:
            self.error_at(self.line_no, self.col_of(index) + e.pos, f"bad string escape: {e.msg}")

    def name(self, what: str) -> str:
        """A bare or JSON-quoted name."""
        pos = self.pos
        tok = self.toks[pos]
        if tok and tok[0] in _NAME_START:
            self.pos = pos + 1
            return tok
        if len(tok) > 1 and tok[0] == '"':
            self.pos = pos + 1
            return self.string(pos)
        self.unexpected(pos, what + " (a name, or a JSON string for other names)")

    def number(self, index: int) -> int | float:
        tok = self.toks[index]
        try:
            if tok.isdigit() and tok.isascii() or _INT_RE.match(tok):
                return int(tok)
            if _FLOAT_RE.match(tok):
                return float(tok)
        except ValueError as e:  # more digits than Python's int() accepts
            self.error(index, f"bad number '{tok[:20]}...': {e}")
        self.error(index, f"bad number '{tok}': expected an integer such as -1, or a float such as 0.5, 1e-05, -inf")

    def integer(self, what: str) -> int:
        pos = self.pos
        tok = self.toks[pos]
        if _kind(tok) != "num":
            self.unexpected(pos, what)
        value = self.number(pos)
        if not isinstance(value, int):
            self.error(pos, f"expected {what}, found float {tok}")
        self.pos = pos + 1
        return value

    def value(self) -> Any:
        pos = self.pos
        tok = self.toks[pos]
        if tok in _VALUE_WORDS:
            self.pos = pos + 1
            return _VALUE_WORDS[tok]
        kind = _kind(tok)
        if kind == "num":
            self.pos = pos + 1
            return self.number(pos)
        if kind == "str":
            self.pos = pos + 1
            return self.string(pos)
        if tok == "[":
            self.pos = pos + 1
            items: list[Any] = []
            if self.accept("]"):
                return items
            while True:
                items.append(self.value())
                if self.accept("]"):
                    return items
                self.expect(",", "',' or ']' in a list")
        if tok == "^":
            self.pos = pos + 1
            return BlockRef(self.integer("a block index after '^'"))
        self.unexpected(pos, _VALUE_EXPECTED, tuple(_VALUE_WORDS))

    def props(self, what: str) -> list[tuple[str, int, Any]]:
        """``{key=value, ...}`` (the opening brace already consumed) as (key, token index, value);
        a key given twice is an error."""
        items: list[tuple[str, int, Any]] = []
        seen: set[str] = set()
        if self.accept("}"):
            return items
        while True:
            key_pos = self.pos
            key = self.name(f"{what} name")
            if key in seen:
                self.error(key_pos, f"duplicate {what} '{key}'")
            seen.add(key)
            self.expect("=", f"'=' after {what} '{key}'")
            items.append((key, key_pos, self.value()))
            if self.accept("}"):
                return items
            self.expect(",", f"',' or '}}' after {what} '{key}'")

    # --- lines
    def parse(self) -> Program:
        n = len(self.lines)
        i = self.skip_to_content(0)
        if i == n:
            self.error_at(n, 0, "empty input: expected a 'program {random_seed=N}' header")
        self.program_header()
        i = self.skip_to_content(i + 1)
        if i == n:
            self.error_at(n, len(self.lines[-1]), "expected 'block 0 {' after the program header, found end of file")
        expected_idx = 0
        while i < n:
            block, open_line = self.block_header(expected_idx)
            i = self.block_body(block, i + 1, open_line)
            expected_idx += 1
            i = self.skip_to_content(i + 1)
        return self.program

    def skip_to_content(self, i: int) -> int:
        n = len(self.lines)
        while i < n and not self.load_line(i):
            i += 1
        return i

    def program_header(self) -> None:
        self.keyword("program", "a 'program {random_seed=N}' header")
        if self.accept("{"):
            for key, key_pos, value in self.props("program property"):
                if key not in _PROGRAM_PROPS:
                    self.error(key_pos, _with_hint(f"unknown program property '{key}'", key, _PROGRAM_PROPS)
                               + f"; known: {', '.join(_PROGRAM_PROPS)}")
                if not isinstance(value, int) or isinstance(value, bool):
                    self.error(key_pos, f"program property '{key}' must be an integer, got {_type_name(value)}")
                self.program.random_seed = value
        self.end_line("the program header")

    def block_header(self, expected_idx: int) -> tuple[Block, int]:
        self.keyword("block", f"'block {expected_idx} {{'" if expected_idx == 0 else None)
        idx_pos = self.pos
        idx = self.integer("a block index")
        if idx != expected_idx:
            self.error(idx_pos, f"expected block {expected_idx} here (blocks are numbered in order), found block {idx}")
        parent = -1
        if _kind(self.toks[self.pos]) == "name":
            self.keyword("parent", "'parent' or '{'")
            parent_pos = self.pos
            parent = self.integer("a parent block index")
            if idx == 0:
                self.error(parent_pos, "block 0 (the global block) cannot have a parent")
            if not 0 <= parent < idx:
                self.error(parent_pos, f"parent {parent} of block {idx} must be an earlier block (0..{idx - 1})")
        self.expect("{", "'parent' or '{'" if parent < 0 else "'{' to open the block")
        self.end_line(f"'block {idx} {{'")
        if idx == 0:
            return self.program.blocks[0], self.line_no
        block = Block(self.program, idx, parent)
        self.program.blocks.append(block)
        return block, self.line_no

    def block_body(self, block: Block, i: int, open_line: int) -> int:
        """Parse the items of ``block`` from line ``i``; returns the index of its closing line."""
        declared: dict[str, int] = {}
        n = len(self.lines)
        while True:
            i = self.skip_to_content(i)
            if i == n:
                self.error_at(n, len(self.lines[-1]),
                              f"end of file inside block {block.idx} (opened at line {open_line}): expected '}}'")
            tok = self.toks[0]
            self.pos = 1
            if tok == "op":
                self.op_line(block)
            elif tok == "var" or tok == "param":
                self.var_line(block, tok == "param", declared)
            elif tok == "}":
                self.end_line(f"the '}}' closing block {block.idx}")
                return i
            else:
                what = f"expected 'var', 'param', 'op' or '}}', found {_describe(tok)}"
                if tok == "block":
                    what += f" (block {block.idx}, opened at line {open_line}, is not closed)"
                elif _kind(tok) == "name":
                    what = _with_hint(what, tok, _BLOCK_ITEMS)
                self.error(0, what)
            i += 1

    def var_line(self, block: Block, is_param: bool, declared: dict[str, int]) -> None:
        name_pos = self.pos
        name = self.name("a variable name")
        if name in declared:
            self.error(name_pos, f"duplicate variable '{name}' in block {block.idx} "
                                 f"(first declared at line {declared[name]})")
        self.expect(":", "':' after the variable name")
        type_pos = self.pos
        var_type = self.toks[type_pos]
        if var_type not in VAR_TYPES:
            if _kind(var_type) != "name":
                self.unexpected(type_pos, "a variable type such as lod_tensor")
            self.error(type_pos, _with_hint(f"unknown variable type '{var_type}'", var_type, VAR_TYPES)
                       + f"; known: {', '.join(VAR_TYPES)}")
        self.pos += 1
        self.expect("<", "'<' before the dtype")
        dtype_pos = self.pos
        dtype = self.toks[dtype_pos]
        if dtype not in DTYPES:
            if _kind(dtype) != "name":
                self.unexpected(dtype_pos, "a dtype such as float32")
            self.error(dtype_pos, _with_hint(f"unknown dtype '{dtype}'", dtype, DTYPES)
                       + f"; known: {', '.join(DTYPES)}")
        self.pos += 1
        self.expect(">", "'>' after the dtype")
        self.expect("[", "'[' to open the shape")
        shape: list[int] = []
        if not self.accept("]"):
            while True:
                shape.append(self.integer("a dimension (an integer, -1 for unknown)"))
                if self.accept("]"):
                    break
                self.expect(",", "',' or ']' in the shape")
        fields: dict[str, Any] = {}
        if self.accept("{"):
            known = _PARAM_PROPS if is_param else _VAR_PROPS
            for key, key_pos, value in self.props("variable property"):
                types = known.get(key)
                if types is None:
                    if key in _PARAM_PROPS:
                        self.error(key_pos,
                                   f"property '{key}' belongs to parameters: declare the variable with 'param'")
                    self.error(key_pos, _with_hint(f"unknown variable property '{key}'", key, known))
                got = _type_name(value)
                if got not in types and not (got == "int" and "float" in types):
                    self.error(key_pos, f"variable property '{key}' must be {' or '.join(sorted(types))}, "
                                        f"got {got} {_describe_value(value)}")
                fields[key] = value
        self.end_line("the variable")
        cls = Parameter if is_param else Variable
        try:
            var = cls(name=name, shape=tuple(shape), dtype=dtype, type=var_type, **fields)
        except IRError as e:
            self.error(name_pos, f"bad variable: {e.message}")
        block.add_var(var)
        declared[name] = self.line_no

    def slots(self, what: str) -> dict[str, list[str]]:
        self.expect("(", f"'(' to open the {what} slots")
        table: dict[str, list[str]] = {}
        if self.accept(")"):
            return table
        toks = self.toks
        while True:
            slot_pos = self.pos
            slot = self.name(f"an {what} slot name")
            if slot in table:
                self.error(slot_pos, f"duplicate {what} slot '{slot}'")
            self.expect("=", f"'=' after slot '{slot}'")
            self.expect("[", f"'[' to open the variables of slot '{slot}'")
            names: list[str] = []
            if toks[self.pos] == "]":
                self.pos += 1
            else:
                while True:
                    names.append(self.name("a variable name"))
                    tok = toks[self.pos]
                    self.pos += 1
                    if tok == "]":
                        break
                    if tok != ",":
                        self.unexpected(self.pos - 1, "',' or ']' in the slot's variable list")
            table[slot] = names
            if self.accept(")"):
                return table
            self.expect(",", f"',' or ')' after slot '{slot}'")

    def op_line(self, block: Block) -> None:
        type_pos = self.pos
        op_type = self.name("an op type")
        if not has_op(op_type):
            self.error(type_pos, _with_hint(f"unknown op type '{op_type}'", op_type, [d.type for d in all_op_defs()]))
        inputs = self.slots("input")
        self.expect("->", "'->' between the input and output slots")
        outputs = self.slots("output")
        attrs: dict[str, Any] = {}
        if self.accept("{"):
            attrs = {key: value for key, _, value in self.props("attribute")}
        self.end_line("the op")
        block._append_raw_op(op_type, inputs, outputs, attrs)


def _describe_value(value: Any) -> str:
    return "none" if value is None else repr(value)


def parse_program(text: str, filename: str = "<string>") -> Program:
    """Parse the canonical text form (``ir.printer``) into a Program; ``filename`` names the
    source in error messages. Raises ``ParseError`` (``FILE:LINE:COL: error: ...``)."""
    if not isinstance(text, str):
        raise ParseError(f"{filename}: error: parse_program needs text (str), got {type(text).__name__}",
                         hint="decode bytes first, or use parse_program_file")
    # Everything parsed stays alive, so the cyclic GC would only rescan a growing heap (it nearly
    # doubles the time on 100k-op programs); pause it while parsing and restore its state after.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _Parser(text, filename).parse()
    finally:
        if gc_was_enabled:
            gc.enable()


def parse_program_file(path: str | os.PathLike[str]) -> Program:
    """Read a UTF-8 text-form file and parse it; errors name the file."""
    filename = os.fspath(path)
    try:
        with open(filename, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ParseError(f"{filename}: error: cannot read the program file: {e}",
                         hint="check the path, and that the file is UTF-8 text written by print(program)") from e
    return parse_program(text, filename)
