"""The ``flotilla`` command-line tool: inspect, check, compare and draw programs.

Subcommands (each one a ``Command`` in ``COMMANDS``; later issues add ``transpile``, ``plan`` and
``launch`` by registering more with ``register_command``):

- ``flotilla dump PROGRAM [--block N] [--format text|json|dot]``
- ``flotilla verify PROGRAM``: prints ``ok: N blocks, M ops`` (exit 0) or every problem (exit 1)
- ``flotilla diff A B``: variable- and op-level differences per block; exit 0 when identical, 1 when
  different, as diff(1) does
- ``flotilla graph PROGRAM -o FILE.dot|.svg|.png [--block N]`` (svg/png through Graphviz's ``dot``)

Invariants:
- A PROGRAM file is told apart by content, never by extension: protobuf when it starts with the
  program magic number (``ir.serialize.is_program_bytes``), otherwise UTF-8 text in the canonical form.
- A user mistake (missing or unreadable file, garbage, parse error, bad block index, unknown output
  extension, bad arguments) prints one ``flotilla: error: ...`` line on stderr (a parse error adds its
  source line and caret) and exits 2; it never shows a traceback.
- This module imports only ``ir`` (and later ``passes``) at top level; ``runtime`` is imported lazily,
  inside the commands that run programs, so inspecting programs needs no jax or grpc.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, NoReturn, Sequence

from ir.core import Block, Program
from ir.errors import FlotillaError
from ir.export import program_to_dot, program_to_json
from ir.parser import parse_program
from ir.printer import format_block, format_op, format_program, format_var
from ir.serialize import is_program_bytes, program_from_bytes
from ir.verify import collect_problems

PROG = "flotilla"

EXIT_OK = 0
EXIT_DIFFERENT = 1  # verify found problems / diff found differences
EXIT_USAGE = 2  # a user mistake: bad arguments, unreadable input

GRAPH_FORMATS = (".dot", ".svg", ".png")


class UsageError(FlotillaError):
    """A mistake in how the command was called or in the files it was given."""

    code = "E900"


# --- argument parsing ------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise ``UsageError`` (one line) instead of printing usage."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, one-line help, how it declares its arguments, and its handler."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def register_command(command: Command) -> Command:
    """Add a subcommand to the ``flotilla`` tool; a name may be registered once."""
    if command.name in COMMANDS:
        raise UsageError(f"subcommand {command.name!r} is registered twice")
    COMMANDS[command.name] = command
    return command


def build_parser() -> argparse.ArgumentParser:
    """The ``flotilla`` argument parser, with one subparser per registered ``Command``."""
    parser = _Parser(prog=PROG, description="Inspect, verify, compare and draw Flotilla programs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS.values():
        sp = sub.add_parser(command.name, help=command.help, description=command.help)
        command.configure(sp)
        sp.set_defaults(handler=command.run)
    return parser


# --- reading programs --------------------------------------------------------------------------------


def load_any_program(path: str) -> Program:
    """Read a program from ``path``: protobuf if the bytes carry the program magic number, else text."""
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such file")
    if os.path.isdir(path):
        raise UsageError(f"{path}: is a directory, expected a program file (text or protobuf)")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UsageError(f"{path}: cannot read: {e.strerror or e}") from None
    if is_program_bytes(data):
        return program_from_bytes(data, path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"{path}: not a Flotilla program: no protobuf program magic number, and not UTF-8 text "
            f"(bad byte at offset {e.start})"
        ) from None
    return parse_program(text, filename=path)


def _checked_block(program: Program, index: int, path: str) -> Block:
    n = program.num_blocks
    if not 0 <= index < n:
        raise UsageError(f"{path}: no block {index}: the program has {n} block(s), numbered 0..{n - 1}")
    return program.blocks[index]


def _count_ops(program: Program) -> int:
    return sum(len(b.ops) for b in program.blocks)


# --- dump ----------------------------------------------------------------------------------------------


def _configure_dump(p: argparse.ArgumentParser) -> None:
    p.add_argument("program", metavar="PROGRAM", help="a program file, text or protobuf")
    p.add_argument("--block", type=int, default=None, metavar="N", help="only block N")
    p.add_argument("--format", choices=("text", "json", "dot"), default="text", help="output form (default: text)")


def _run_dump(args: argparse.Namespace) -> int:
    program = load_any_program(args.program)
    if args.block is not None:
        _checked_block(program, args.block, args.program)
    if args.format == "text":
        text = format_program(program) if args.block is None else format_block(program.blocks[args.block]) + "\n"
    elif args.format == "json":
        text = program_to_json(program)
        if args.block is not None:
            text = _json_block(text, args.block)
    else:
        text = program_to_dot(program, block_idx=args.block or 0)
    _write_stdout(text)
    return EXIT_OK


def _json_block(program_json: str, index: int) -> str:
    """The JSON of one block, taken from the program's JSON form."""
    doc = json.loads(program_json)
    blocks = doc.get("blocks") if isinstance(doc, dict) else None
    if not isinstance(blocks, list) or not 0 <= index < len(blocks):
        raise UsageError(f"the program's JSON form has no block {index}")
    return json.dumps(blocks[index], indent=2, sort_keys=False) + "\n"


# --- verify ------------------------------------------------------------------------------------------


def _configure_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("program", metavar="PROGRAM", help="a program file, text or protobuf")


def _run_verify(args: argparse.Namespace) -> int:
    program = load_any_program(args.program)
    problems = collect_problems(program)
    if not problems:
        _write_stdout(f"ok: {program.num_blocks} blocks, {_count_ops(program)} ops\n")
        return EXIT_OK
    lines = [f"{args.program}: {len(problems)} problem(s) found by the verifier:"]
    lines += [f"  - {p}" for p in problems]
    _write_stdout("\n".join(lines) + "\n")
    return EXIT_DIFFERENT


# --- diff ----------------------------------------------------------------------------------------------


def _configure_diff(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A", help="the old program file, text or protobuf")
    p.add_argument("b", metavar="B", help="the new program file, text or protobuf")


def diff_programs(a: Program, b: Program, a_name: str = "A", b_name: str = "B") -> list[str]:
    """The differences between two programs, block by block, as lines; empty when they are equal.

    Blocks are matched by index. Variables are matched by name (removed, added, changed with their old
    and new text); ops, which have no identity, are compared as a unified diff of their text lines.
    """
    if format_program(a) == format_program(b):
        return []
    lines = [f"--- {a_name}", f"+++ {b_name}"]
    if a.random_seed != b.random_seed:
        lines.append(f"program: random_seed {a.random_seed} -> {b.random_seed}")
    for idx in range(max(a.num_blocks, b.num_blocks)):
        if idx >= b.num_blocks:
            blk = a.blocks[idx]
            lines.append(f"block {idx}: removed ({len(blk.vars)} vars, {len(blk.ops)} ops)")
            continue
        if idx >= a.num_blocks:
            blk = b.blocks[idx]
            lines.append(f"block {idx}: added ({len(blk.vars)} vars, {len(blk.ops)} ops)")
            continue
        lines += _diff_block(a.blocks[idx], b.blocks[idx], a_name, b_name)
    return lines


def _diff_block(ba: Block, bb: Block, a_name: str, b_name: str) -> list[str]:
    out: list[str] = []
    if ba.parent_idx != bb.parent_idx:
        out.append(f"  parent: {ba.parent_idx} -> {bb.parent_idx}")
    removed = [format_var(v) for name, v in ba.vars.items() if name not in bb.vars]
    added = [format_var(v) for name, v in bb.vars.items() if name not in ba.vars]
    changed = [
        (format_var(v), format_var(bb.vars[name]))
        for name, v in ba.vars.items()
        if name in bb.vars and format_var(v) != format_var(bb.vars[name])
    ]
    a_ops = [format_op(op) for op in ba.ops]
    b_ops = [format_op(op) for op in bb.ops]
    op_diff = list(
        difflib.unified_diff(a_ops, b_ops, fromfile=f"{a_name} block {ba.idx}", tofile=f"{b_name} block {bb.idx}",
                             lineterm="", n=2)
    )
    if removed or added or changed:
        out.append(f"  variables: {len(removed)} removed, {len(added)} added, {len(changed)} changed")
        out += [f"    - {t}" for t in removed]
        out += [f"    + {t}" for t in added]
        for old, new in changed:
            out += [f"    ~ {old}", f"      -> {new}"]
    if op_diff:
        n_a, n_b = len(a_ops), len(b_ops)
        out.append(f"  ops: {n_a} -> {n_b}")
        out += ["    " + line for line in op_diff]
    if not out:
        return []
    return [f"block {ba.idx}:"] + out


def _run_diff(args: argparse.Namespace) -> int:
    a = load_any_program(args.a)
    b = load_any_program(args.b)
    lines = diff_programs(a, b, args.a, args.b)
    if not lines:
        return EXIT_OK
    _write_stdout("\n".join(lines) + "\n")
    return EXIT_DIFFERENT


# --- graph ---------------------------------------------------------------------------------------------


def _configure_graph(p: argparse.ArgumentParser) -> None:
    p.add_argument("program", metavar="PROGRAM", help="a program file, text or protobuf")
    p.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="where to write: FILE.dot, or FILE.svg / FILE.png (needs Graphviz's dot)")
    p.add_argument("--block", type=int, default=0, metavar="N", help="which block to draw (default: 0)")


def _run_graph(args: argparse.Namespace) -> int:
    ext = os.path.splitext(args.output)[1].lower()
    if ext not in GRAPH_FORMATS:
        raise UsageError(f"cannot write {args.output!r}: unknown output extension {ext or '(none)'!r}, "
                         f"expected one of {', '.join(GRAPH_FORMATS)}")
    dot_exe = None
    if ext != ".dot":
        dot_exe = shutil.which("dot")
        if dot_exe is None:
            raise UsageError(f"cannot write {args.output}: Graphviz's dot is not installed (not found on PATH); "
                             "write a .dot file instead (-o FILE.dot) and render it with Graphviz elsewhere")
    program = load_any_program(args.program)
    _checked_block(program, args.block, args.program)
    dot_text = program_to_dot(program, block_idx=args.block)
    if dot_exe is None:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(dot_text)
        except OSError as e:
            raise UsageError(f"cannot write {args.output}: {e.strerror or e}") from None
        return EXIT_OK
    try:
        done = subprocess.run([dot_exe, f"-T{ext[1:]}", "-o", args.output], input=dot_text.encode("utf-8"),
                              capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UsageError(f"cannot write {args.output}: running Graphviz's dot failed: {e}") from None
    if done.returncode != 0:
        detail = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise UsageError(f"cannot write {args.output}: Graphviz's dot exited with status {done.returncode}"
                         + (f": {detail[0]}" if detail else ""))
    return EXIT_OK


# --- running -------------------------------------------------------------------------------------------


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


_LOCATED = re.compile(r"^(?P<loc>.*?:\d+:\d+): error: (?P<msg>.*)$")


def error_text(exc: FlotillaError) -> str:
    """The ``flotilla: error: ...`` text for an error: one line, plus a parse error's source and caret."""
    first, _, rest = exc.message.partition("\n")
    m = _LOCATED.match(first)
    if m:
        first = f"{m.group('loc')}: {m.group('msg')}"
    if exc.hint:
        first += f" (hint: {exc.hint})"
    text = f"{PROG}: error: {first}"
    # Only a located error (a parse error) brings its source line and caret along.
    if m and rest.strip():
        text += "\n" + rest.rstrip("\n")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``flotilla`` tool on ``argv`` (``sys.argv[1:]`` by default); returns the exit status."""
    try:
        args = build_parser().parse_args(list(argv) if argv is not None else None)
        return int(args.handler(args))
    except FlotillaError as e:
        sys.stderr.write(error_text(e) + "\n")
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader went away (`flotilla dump big.txt | head`): stop quietly, as cat(1) does.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except SystemExit as e:  # --help and --version exit through argparse
        return e.code if isinstance(e.code, int) else EXIT_OK


register_command(Command("dump", "print a program (or one block) as text, JSON or DOT", _configure_dump, _run_dump))
register_command(Command("verify", "check a program; print 'ok' or every problem", _configure_verify, _run_verify))
register_command(Command("diff", "show how program B differs from program A (exit 1 when they differ)",
                         _configure_diff, _run_diff))
register_command(Command("graph", "draw a block as a graph: .dot, or .svg/.png through Graphviz",
                         _configure_graph, _run_graph))


if __name__ == "__main__":
    sys.exit(main())
