"""The ``flotilla`` command-line tool: inspect, check, compare, draw, transpile and launch programs.

``flotilla --version`` prints the installed version (the package metadata; in a source tree that is not
installed, ``pyproject.toml``'s). Subcommands (each one a ``Command`` in ``COMMANDS``, registered with
``register_command``; the top-level help lists them all, and its description names each):

- ``flotilla dump PROGRAM [--block N] [--format text|json|dot]``
- ``flotilla verify PROGRAM``: prints ``ok: N blocks, M ops`` (exit 0) or every problem (exit 1)
- ``flotilla diff A B [--by-name]``: variable- and op-level differences per block (``ir.diff``), B's
  variables first aligned with A's by structure (so the same model built twice in one process, ``fc_0``
  against ``fc_2``, differs by one line of renames; ``--by-name`` compares names as they are); exit 0 and
  one line saying so when identical, 1 when different, as diff(1) does
- ``flotilla graph PROGRAM -o FILE.dot|.svg|.png [--block N] [--role forward|backward|optimize|rpc]...
  [--ops-only]`` (svg/png through Graphviz's ``dot``): ops clustered by role, persistable variables in one
  table at the side (see ``ir.export``); ``flotilla graph --job DIR -o FILE`` draws a transpile output
  directory: which trainer send reaches which pserver block. Prints one line naming what it wrote
- ``flotilla transpile MAIN --startup STARTUP --pservers EP,EP --trainers N [--trainer-id I] [--async
  [--geo-sgd K]] [--split-method round_robin|hash_name] [--min-block-size N] [--no-slice] -o DIR``, or in
  the collective modes ``flotilla transpile MAIN --startup STARTUP --mode nccl2|collective --trainers EP,EP
  [--collective-mode grad_allreduce|local_sgd] [--fuse-grad-size-mb M] [--local-sgd-steps K] -o DIR``
  (``--trainers`` then lists every trainer's endpoint, as Fluid's nccl2 mode takes it), or ``--mode hybrid``
  with both ``--pservers EP,EP`` and ``--trainers EP,EP`` (dense gradients allreduced among the trainers,
  the distributed lookup table on the pservers; ``--async`` applies to the table): writes every role's
  main and startup programs as ``ROLE.main.pb``/``.txt`` and ``ROLE.startup.pb``/``.txt`` into DIR (the
  role made filesystem-safe: ``pserver@127.0.0.1:6174`` → ``pserver@127.0.0.1_6174``); without
  ``--trainer-id`` every trainer's programs are written
- ``flotilla plan`` (the same inputs, no ``-o``) ``[--format text|dot|png] [--output FILE]``: which
  parameter block goes to which pserver (param, block, rows, shape, bytes, endpoint), bytes per pserver
  and the balance (max/mean bytes per pserver, reported by ``transpiler.plan``); png through Graphviz's ``dot``
- ``flotilla memory PROGRAM [--level 0|1] [--skip-grads] [--skip NAME]... [--batch-size N] [-o FILE]``:
  ``memory_optimize`` the program: peak live bytes by the liveness estimate before and after, then one
  line per variable reused; ``-o`` also writes the rewritten program
- ``flotilla checkpoint inspect DIR``: every variable a checkpoint holds (its file, name, type, dtype,
  shape, and which slice of which variable or which table shard), after verifying each part's manifest;
  a torn or tampered file is one error line naming it (exit 2). Read-only
- ``flotilla launch [--server_num N --worker_num M | --servers ... --workers ... | --nproc_per_node N]
  [--log_dir DIR] [--started_port P] [--stop_timeout S] SCRIPT [ARGS...]``: ``runtime.launch`` (its
  arguments, help and exit statuses)

Invariants:
- A PROGRAM file is told apart by content, never by extension: protobuf when it starts with the
  program magic number (``ir.serialize.is_program_bytes``), otherwise UTF-8 text in the canonical form.
- A user mistake (missing or unreadable file, garbage, parse error, bad block index, unknown output
  extension, bad arguments) prints one ``flotilla: error: ...`` line on stderr (a parse error adds its
  source line and caret) and exits 2; it never shows a traceback.
- This module imports only ``ir`` at top level; the transpiler façade (and so ``passes``) is imported
  inside ``transpile`` and ``plan``, and ``runtime`` inside the commands that run programs, so
  inspecting programs needs no jax or grpc.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Sequence

from ir.core import Block, Program
from ir.diff import diff_programs
from ir.errors import FlotillaError, VerifyError
from ir.export import ROLE_GROUPS, job_to_dot, program_to_dot, program_to_json
from ir.parser import parse_program
from ir.printer import format_block, format_program
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


def version() -> str:
    """The installed package's version; in a source tree that is not installed, ``pyproject.toml``'s."""
    try:
        return importlib.metadata.version(PROG)
    except importlib.metadata.PackageNotFoundError:
        pyproject = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
        try:
            with open(pyproject, encoding="utf-8") as f:
                m = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.MULTILINE)
        except OSError:
            m = None
        return m.group(1) if m else "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The ``flotilla`` argument parser, with one subparser per registered ``Command``."""
    description = ("Inspect, verify, compare and draw Flotilla programs, transpile them for a distributed job "
                   f"and launch one. Commands: {', '.join(COMMANDS)}; 'flotilla COMMAND --help' for each.")
    parser = _Parser(prog=PROG, description=description)
    parser.add_argument("--version", action="version", version=f"{PROG} {version()}")
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
    p.add_argument("--by-name", action="store_true", dest="by_name",
                   help="match variables by name only (default: first align B's variables with A's by where the "
                        "ops use them, so fc_2.w_0 built second compares with fc_0.w_0)")


def _run_diff(args: argparse.Namespace) -> int:
    a = load_any_program(args.a)
    b = load_any_program(args.b)
    lines = diff_programs(a, b, args.a, args.b, align=not args.by_name)
    if not lines:
        _write_stdout(f"identical: {args.a} and {args.b} ({_count_ops_and_blocks(a)})\n")
        return EXIT_OK
    _write_stdout("\n".join(lines) + "\n")
    return EXIT_DIFFERENT


# --- graph ---------------------------------------------------------------------------------------------


def _configure_graph(p: argparse.ArgumentParser) -> None:
    p.add_argument("program", metavar="PROGRAM",
                   help="a program file, text or protobuf (with --job: a directory `flotilla transpile -o` wrote)")
    p.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="where to write: FILE.dot, or FILE.svg / FILE.png (needs Graphviz's dot)")
    p.add_argument("--block", type=int, default=0, metavar="N", help="which block to draw (default: 0)")
    p.add_argument("--role", action="append", choices=ROLE_GROUPS, dest="roles", default=None,
                   help="draw only the ops of this role group (repeat for several; default: all)")
    p.add_argument("--ops-only", action="store_true", dest="ops_only",
                   help="draw ops only, each linked to the ops whose results it reads (no variable nodes)")
    p.add_argument("--job", action="store_true",
                   help="PROGRAM is a transpile output directory: draw which trainer send reaches which pserver "
                        "block")


def _job_programs(directory: str) -> dict[str, Program]:
    """Role → main program of every ``ROLE.main.pb`` in ``directory`` (trainers first, by id)."""
    if not os.path.isdir(directory):
        raise UsageError(f"{directory}: not a directory; --job draws what `flotilla transpile -o DIR` wrote")
    suffix = ".main.pb"
    stems = sorted(f[:-len(suffix)] for f in os.listdir(directory) if f.endswith(suffix))
    if not stems:
        raise UsageError(f"{directory}: no ROLE{suffix} files; write them with `flotilla transpile ... -o {directory}`")

    def order(stem: str) -> tuple[int, int, str]:
        m = re.fullmatch(r"trainer\.(\d+)", stem)
        return (0, int(m.group(1)), stem) if m else (1, 0, stem)

    return {stem: load_any_program(os.path.join(directory, stem + suffix)) for stem in sorted(stems, key=order)}


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
    if args.job:
        if args.roles or args.ops_only or args.block:
            raise UsageError("--job draws the whole job; it takes no --block, --role or --ops-only")
        programs = _job_programs(args.program)
        dot_text = job_to_dot(programs)
        what = f"the job in {args.program} ({len(programs)} roles)"
    else:
        program = load_any_program(args.program)
        _checked_block(program, args.block, args.program)
        dot_text = program_to_dot(program, block_idx=args.block, roles=args.roles, ops_only=args.ops_only)
        what = f"block {args.block} of {args.program} ({len(program.blocks[args.block].ops)} ops)"
    if dot_exe is None:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(dot_text)
        except OSError as e:
            raise UsageError(f"cannot write {args.output}: {e.strerror or e}") from None
    else:
        _render_dot(dot_exe, dot_text, ext[1:], args.output)
    _write_stdout(f"wrote {args.output}: {what}\n")
    return EXIT_OK


# --- transpile and plan ----------------------------------------------------------------------------------

SPLIT_METHODS = ("round_robin", "hash_name")
PLAN_FORMATS = ("text", "dot", "png")
_UNSAFE = re.compile(r"[^A-Za-z0-9@._-]")


def role_file_stem(role: str) -> str:
    """A filesystem-safe file-name stem for a role: ``pserver@127.0.0.1:6174`` → ``pserver@127.0.0.1_6174``
    (every character outside ``A-Za-z0-9@._-`` becomes ``_``)."""
    return _UNSAFE.sub("_", role)


def _configure_transpile_inputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("main", metavar="MAIN", help="the training program (main), text or protobuf")
    p.add_argument("--startup", required=True, metavar="STARTUP", help="its startup program, text or protobuf")
    p.add_argument("--pservers", default=None, metavar="EP,EP",
                   help="comma-separated pserver endpoints host:port (pserver mode)")
    p.add_argument("--trainers", required=True, metavar="N|EP,EP",
                   help="number of trainers (pserver mode), or every trainer's endpoint (nccl2/collective)")
    p.add_argument("--mode", choices=("pserver", "nccl2", "collective", "hybrid"), default="pserver",
                   help="pserver: parameter servers (default, needs --pservers); nccl2: Fluid's nccl2 mode, "
                        "the trainers average their gradients by allreduce (no pservers; --trainers lists every "
                        "trainer's endpoint); collective: the same rewrite under Fluid 1.6's name; hybrid: dense "
                        "gradients by allreduce, the distributed lookup table on the pservers (needs --pservers "
                        "and every trainer's endpoint in --trainers)")
    p.add_argument("--collective-mode", choices=("grad_allreduce", "local_sgd"), default="grad_allreduce",
                   dest="collective_mode", help="collective modes: average gradients, or parameters every K steps")
    p.add_argument("--fuse-grad-size-mb", type=float, default=32.0, metavar="M", dest="fuse_grad_size_mb",
                   help="collective modes: gradient bucket size in MiB, 0 for one allreduce a gradient (default 32)")
    p.add_argument("--local-sgd-steps", type=int, default=1, metavar="K", dest="local_sgd_steps",
                   help="local_sgd: steps between parameter averagings (default 1)")
    p.add_argument("--trainer-id", type=int, default=None, metavar="I", dest="trainer_id",
                   help="the trainer to build (default: transpile: every trainer; plan: 0)")
    p.add_argument("--async", action="store_true", dest="async_mode", help="asynchronous training (no barriers)")
    p.add_argument("--geo-sgd", type=int, default=None, metavar="K", dest="geo_sgd",
                   help="with --async: Geo-SGD, trainers optimize locally (a distributed table too) and sync "
                        "parameter deltas every K steps")
    p.add_argument("--split-method", choices=SPLIT_METHODS, default="round_robin", dest="split_method",
                   help="how blocks are placed on pservers (default: round_robin)")
    p.add_argument("--min-block-size", type=int, default=8192, metavar="N", dest="min_block_size",
                   help="smallest block, in elements (default: 8192)")
    p.add_argument("--no-slice", action="store_true", dest="no_slice",
                   help="do not slice variables (slice_var_up=False): one block per variable")


@dataclass(frozen=True)
class _Transpiled:
    """What a transpile command produced: every role's programs, the plan, warnings."""

    programs: Any  # ir.program_set.ProgramSet
    plan: Any  # passes.dist_plan.DistPlan
    warnings: tuple[str, ...]


def _transpile(args: argparse.Namespace, trainer_ids: Sequence[int]) -> _Transpiled:
    """Transpile ``args.main`` once per trainer id; the set holds each trainer's role, then every
    pserver's (from the first transpile: pserver programs do not depend on the trainer id)."""
    # Imported here so that `flotilla dump` and friends load neither passes nor the façade.
    from ir.program_set import ProgramRole, ProgramSet
    from transpiler import DistributeTranspiler, DistributeTranspilerConfig, HashName, RoundRobin

    main = load_any_program(args.main)
    startup = load_any_program(args.startup)
    split = HashName if args.split_method == "hash_name" else RoundRobin
    config = DistributeTranspilerConfig(slice_var_up=not args.no_slice, split_method=split,
                                        min_block_size=args.min_block_size, wait_port=False, mode=args.mode,
                                        collective_mode=args.collective_mode if args.mode != "pserver" else None,
                                        fuse_grad_size_in_MB=args.fuse_grad_size_mb,
                                        local_sgd_steps=args.local_sgd_steps, geo_sgd_mode=args.geo_sgd is not None,
                                        geo_sgd_need_push_nums=100 if args.geo_sgd is None else args.geo_sgd)
    programs = ProgramSet()
    pservers: list[tuple[ProgramRole, Program, Program]] = []
    plan = None
    notes: list[str] = []
    for trainer_id in trainer_ids:
        t = DistributeTranspiler(config)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # reported once, below, as `flotilla: warning:` lines
                t.transpile(trainer_id, program=main, pservers=args.pservers, trainers=args.trainer_arg,
                            sync_mode=not args.async_mode, startup_program=startup)
        except VerifyError as e:
            raise UsageError(f"the transpiled programs do not verify: {e.problems[0]}"
                             + (f" (and {len(e.problems) - 1} more problem(s))" if len(e.problems) > 1 else ""),
                             hint=None) from None
        done = t.program_set
        for _, progs in done.items():
            if progs.role.is_trainer:
                programs.add(progs.role, progs.main, progs.startup)
            elif plan is None:
                pservers.append((progs.role, progs.main, progs.startup))
        if plan is None:
            plan = t.plan
            notes = list(t.warnings)
    for role, main_prog, startup_prog in pservers:
        programs.add(role, main_prog, startup_prog)
    return _Transpiled(programs, plan, tuple(notes))


def _warn(notes: Sequence[str]) -> None:
    for note in notes:
        sys.stderr.write(f"{PROG}: warning: {note}\n")


def _check_trainer_id(args: argparse.Namespace) -> None:
    """Read ``--trainers`` for the mode (a count, or the trainers' endpoints) into ``args.trainers`` (the
    count) and ``args.trainer_arg`` (what ``transpile`` takes), and range-check ``--trainer-id`` against
    it (the façade checks them too, but names the Python arguments; this names the flags)."""
    text = str(args.trainers).strip()
    if args.mode == "pserver":
        if args.pservers is None:
            raise UsageError("--pservers is required in pserver mode",
                             hint="give --pservers EP,EP, or --mode nccl2 with --trainers EP,EP")
        if not text.isdigit():
            raise UsageError(f"--trainers {text!r}: expected the number of trainers in pserver mode",
                             hint="e.g. --trainers 2 (endpoints are for --mode nccl2)")
        args.trainers = args.trainer_arg = int(text)
    else:
        if args.mode == "hybrid" and args.pservers is None:
            raise UsageError("--pservers is required in hybrid mode (they hold the distributed lookup table)",
                             hint="give --pservers EP,EP and every trainer's endpoint in --trainers EP,EP")
        if text.isdigit():
            raise UsageError(f"--trainers {text}: --mode {args.mode} needs every trainer's endpoint",
                             hint="e.g. --trainers 127.0.0.1:6170,127.0.0.1:6171")
        args.trainer_arg = text
        args.trainers = len([e for e in text.split(",") if e.strip()])
    if args.trainers < 1:
        raise UsageError(f"--trainers {args.trainers}: expected at least 1 trainer")
    if args.trainer_id is not None and not 0 <= args.trainer_id < args.trainers:
        raise UsageError(f"--trainer-id {args.trainer_id} is out of range: expected 0..{args.trainers - 1} "
                         f"for --trainers {args.trainers}")


def _configure_transpile(p: argparse.ArgumentParser) -> None:
    _configure_transpile_inputs(p)
    p.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="directory to write ROLE.main.pb/.txt and ROLE.startup.pb/.txt into (created if needed)")


def _count_ops_and_blocks(program: Program) -> str:
    return f"{program.num_blocks} block(s), {_count_ops(program)} ops"


def _run_transpile(args: argparse.Namespace) -> int:
    from ir.serialize import save_program

    _check_trainer_id(args)
    ids = [args.trainer_id] if args.trainer_id is not None else list(range(args.trainers))
    out_dir = args.output
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UsageError(f"-o {out_dir}: exists and is not a directory")
    result = _transpile(args, ids)
    stems: dict[str, str] = {}
    for role in result.programs.roles:
        stem = role_file_stem(role)
        if stem in stems:
            raise UsageError(f"roles {stems[stem]!r} and {role!r} map to the same file name {stem!r}",
                             hint="give pservers endpoints that differ in letters, digits or dots")
        stems[stem] = role
    try:
        os.makedirs(out_dir, exist_ok=True)
        lines = []
        for stem, role in stems.items():
            progs = result.programs[role]
            for kind, program in (("main", progs.main), ("startup", progs.startup)):
                save_program(program, os.path.join(out_dir, f"{stem}.{kind}.pb"))
                with open(os.path.join(out_dir, f"{stem}.{kind}.txt"), "w", encoding="utf-8") as f:
                    f.write(format_program(program))
            lines.append(f"  {role}: main {_count_ops_and_blocks(progs.main)}; "
                         f"startup {_count_ops_and_blocks(progs.startup)} -> {stem}.{{main,startup}}.{{pb,txt}}")
    except OSError as e:
        raise UsageError(f"cannot write into {out_dir}: {e.strerror or e}") from None
    plan = result.plan
    if args.mode == "hybrid":
        head = (f"transpiled {args.main}: hybrid, {len(plan.pservers)} pserver(s) holding the distributed table "
                f"({'sync' if plan.sync_mode else 'async'}), {plan.trainers} trainer(s) allreducing the dense "
                f"gradients in buckets of {args.fuse_grad_size_mb:g} MiB")
    elif args.mode != "pserver":
        head = (f"transpiled {args.main}: {args.mode} ({args.collective_mode}), {plan.trainers} trainer(s), "
                f"gradient buckets of {args.fuse_grad_size_mb:g} MiB")
    else:
        head = (f"transpiled {args.main}: {len(plan.pservers)} pserver(s), {plan.trainers} trainer(s), "
                f"{'sync' if plan.sync_mode else 'async'}, {args.split_method}, "
                f"{'min_block_size ' + str(plan.min_block_size) if plan.slice_var_up else 'no slicing'}")
    _warn(result.warnings)
    _write_stdout("\n".join([head, *lines, f"wrote {4 * len(stems)} files to {out_dir}"]) + "\n")
    return EXIT_OK


def _configure_plan(p: argparse.ArgumentParser) -> None:
    _configure_transpile_inputs(p)
    p.add_argument("--format", choices=PLAN_FORMATS, default="text", help="output form (default: text)")
    p.add_argument("--output", metavar="FILE", default=None,
                   help="write here instead of stdout (required for --format png)")


def _run_plan(args: argparse.Namespace) -> int:
    _check_trainer_id(args)
    if args.mode != "pserver":
        raise UsageError(f"plan shows where parameter blocks live on pservers; --mode {args.mode} has none",
                         hint="use 'flotilla transpile --mode nccl2 ... -o DIR' to see the trainer programs")
    dot_exe = None
    if args.format == "png":
        if args.output is None:
            raise UsageError("--format png needs --output FILE.png (a picture is not written to stdout)")
        dot_exe = shutil.which("dot")
        if dot_exe is None:
            raise UsageError(f"cannot write {args.output}: Graphviz's dot is not installed (not found on PATH); "
                             "use --format dot and render it with Graphviz elsewhere")
    from transpiler.plan import format_plan_dot, format_plan_text, plan_rows  # lazy: the façade imports passes

    result = _transpile(args, [args.trainer_id or 0])
    rows = plan_rows(result.plan, result.programs)
    _warn(result.warnings)
    if args.format == "text":
        text = format_plan_text(result.plan, rows)
    else:
        text = format_plan_dot(result.plan, rows)
    if dot_exe is not None:
        _render_dot(dot_exe, text, "png", args.output)
        return EXIT_OK
    if args.output is None:
        _write_stdout(text)
        return EXIT_OK
    try:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise UsageError(f"cannot write {args.output}: {e.strerror or e}") from None
    return EXIT_OK


def _render_dot(dot_exe: str, dot_text: str, fmt: str, output: str) -> None:
    """Run Graphviz's ``dot -T<fmt> -o <output>`` on ``dot_text``; a failure is one UsageError line."""
    try:
        done = subprocess.run([dot_exe, f"-T{fmt}", "-o", output], input=dot_text.encode("utf-8"),
                              capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UsageError(f"cannot write {output}: running Graphviz's dot failed: {e}") from None
    if done.returncode != 0:
        detail = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise UsageError(f"cannot write {output}: Graphviz's dot exited with status {done.returncode}"
                         + (f": {detail[0]}" if detail else ""))


# --- launch --------------------------------------------------------------------------------------------


def _configure_launch(p: argparse.ArgumentParser) -> None:
    # Every argument goes to runtime.launch untouched (its parser owns the options and the --help text),
    # so no argument may be taken as an option here: with no prefix character, all are positional.
    p.prefix_chars = "\0"
    p.add_argument("launch_args", nargs=argparse.REMAINDER, metavar="...",
                   help="the launcher's arguments: see 'flotilla launch --help'")


def _run_launch(args: argparse.Namespace) -> int:
    from runtime.launch import launch  # lazy: runtime imports jax

    return launch(args.launch_args, prog=f"{PROG} launch")


# --- memory --------------------------------------------------------------------------------------------


def _configure_memory(p: argparse.ArgumentParser) -> None:
    p.add_argument("program", metavar="PROGRAM", help="a program file, text or protobuf")
    p.add_argument("--level", type=int, choices=(0, 1), default=0,
                   help="0: reuse a dead variable of the same dtype and shape; 1: of the same dtype, at least as "
                   "large (default: 0)")
    p.add_argument("--skip-grads", action="store_true", dest="skip_grads",
                   help="never reuse parameter gradients (use before transpiling for parameter servers)")
    p.add_argument("--skip", action="append", default=[], metavar="NAME",
                   help="a variable to leave alone (skip_opt_set); repeatable")
    p.add_argument("--batch-size", type=int, default=1, metavar="N", dest="batch_size",
                   help="size of the -1 (batch) extents in the byte estimate (default: 1)")
    p.add_argument("-o", "--output", default=None, metavar="FILE",
                   help="also write the rewritten program: protobuf for FILE.pb, else text")


def _run_memory(args: argparse.Namespace) -> int:
    from transpiler.memory_optimization import memory_optimize  # lazy: the façade imports passes

    if args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size}: expected at least 1")
    program = load_any_program(args.program)
    report = memory_optimize(program, skip_opt_set=list(args.skip), level=args.level, skip_grads=args.skip_grads,
                             batch_size=args.batch_size)
    pct = f"{100.0 * report.bytes_saved / report.bytes_before:.1f}%" if report.bytes_before else "n/a"
    lines = [f"{args.program}: memory_optimize level {args.level}{' (skip grads)' if args.skip_grads else ''}: "
             f"peak live bytes (liveness estimate, batch {args.batch_size}) {report.bytes_before} -> "
             f"{report.bytes_after} (saved {report.bytes_saved}, {pct}); {len(report.reused)} variable(s) reused"]
    lines += ["  " + r.line() for r in report.reused]
    if args.output is not None:
        from ir.serialize import save_program

        try:
            if args.output.endswith(".pb"):
                save_program(program, args.output)
            else:
                with open(args.output, "w", encoding="utf-8") as f:
                    f.write(format_program(program))
        except OSError as e:
            raise UsageError(f"cannot write {args.output}: {e.strerror or e}") from None
        lines.append(f"wrote {args.output}")
    _write_stdout("\n".join(lines) + "\n")
    return EXIT_OK


# --- checkpoint ----------------------------------------------------------------------------------------


def _configure_checkpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("inspect",), help="inspect: list the variables and verify the manifests")
    p.add_argument("dirname", metavar="DIR", help="a checkpoint directory written by save_persistables")


def _slice_text(layout: dict[str, Any] | None) -> str:
    if not layout:
        return "whole"
    if layout.get("how") == "rows":
        return f"rows {layout.get('offset')}.. of {layout.get('of')}"
    if layout.get("how") == "mod":
        return f"shard {layout.get('index')} of table {layout.get('of')}"
    return f"copy of {layout.get('of')}"


def _run_checkpoint(args: argparse.Namespace) -> int:
    from runtime.io import describe_checkpoint  # lazy: runtime imports jax

    rows = describe_checkpoint(args.dirname)
    lines = [f"{os.path.join(r['part'], r['file'])}: {r['name']} {r['type']} {r['dtype']} {r['shape']} "
             f"({_slice_text(r['slice'])})" for r in rows]
    parts = sorted({r["part"] for r in rows})
    lines.append(f"ok: {len(rows)} variable(s) in {len(parts)} part(s), manifests verified")
    _write_stdout("\n".join(lines) + "\n")
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
register_command(Command("graph", "draw a block (or with --job a transpiled job) as a graph: .dot, or .svg/.png "
                         "through Graphviz", _configure_graph, _run_graph))
register_command(Command("transpile", "transpile a training program for parameter servers (pserver mode) or for "
                         "allreduce among trainers (--mode nccl2|collective); write every role's programs (.pb and "
                         ".txt) into a directory", _configure_transpile, _run_transpile))
register_command(Command("plan", "show which parameter block goes to which pserver, bytes per pserver and the "
                         "balance (text, dot or png)", _configure_plan, _run_plan))
register_command(Command("memory", "memory_optimize a program: peak live bytes (liveness estimate) before and "
                         "after, and the variables reused", _configure_memory, _run_memory))
register_command(Command("checkpoint", "inspect a checkpoint: every variable (name, type, dtype, shape, file, which "
                         "slice or shard), and verify its manifests (exit 2 naming a torn or tampered file)",
                         _configure_checkpoint, _run_checkpoint))
register_command(Command("launch", "start a local cluster (pservers and trainers, or collective trainers) "
                         "running a training script", _configure_launch, _run_launch))


if __name__ == "__main__":
    sys.exit(main())
