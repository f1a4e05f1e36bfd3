"""End-to-end tests of the installed ``flotilla`` executable: every subcommand, on programs written as
text and as protobuf, and every user-mistake path (one ``flotilla: error:`` line, exit 2, no traceback).
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from ir.core import Program
from ir.export import program_to_dot
from ir.printer import format_block, format_program
from ir.serialize import program_to_bytes, save_program

TIMEOUT_S = 60


# --- programs ------------------------------------------------------------------------------------------


def build_fc_program() -> Program:
    """A small valid forward program: y = mean(x @ w + b)."""
    p = Program()
    b = p.global_block()
    b.create_var("x", shape=(-1, 4), is_data=True, stop_gradient=True)
    b.create_parameter("fc_w", shape=(4, 3))
    b.create_parameter("fc_b", shape=(3,))
    b.create_var("fc_out")
    b.create_var("fc_sum")
    b.create_var("loss")
    b.append_op("mul", {"X": "x", "Y": "fc_w"}, {"Out": "fc_out"})
    b.append_op("elementwise_add", {"X": "fc_out", "Y": "fc_b"}, {"Out": "fc_sum"})
    b.append_op("mean", {"X": "fc_sum"}, {"Out": "loss"})
    return p


def build_two_block_program() -> Program:
    p = build_fc_program()
    sub = p.create_block(0)
    sub.create_var("scaled", shape=(1,))
    sub.append_op("square", {"X": "loss"}, {"Out": "scaled"})
    p.rollback()
    return p


def build_changed_program() -> Program:
    """``build_fc_program`` with one variable removed, one added, one changed, and an op added."""
    p = build_fc_program()
    b = p.global_block()
    b.replace_var("fc_w", shape=(4, 5))
    b.remove_var("fc_b")
    b.create_var("sq", shape=(1,))
    b.append_op("square", {"X": "loss"}, {"Out": "sq"})
    return p


def build_broken_program() -> Program:
    """A program the verifier rejects: an op reads a variable that is not defined."""
    p = build_fc_program()
    p.global_block().remove_var("fc_w")
    return p


def write_program(program: Program, folder: pathlib.Path, name: str, form: str) -> pathlib.Path:
    """Write ``program`` as ``form`` ('text' or 'proto'); the file name never tells which."""
    path = folder / name
    if form == "text":
        path.write_text(format_program(program))
    else:
        save_program(program, str(path))
    return path


FORMS = ["text", "proto"]


# --- running the tool ----------------------------------------------------------------------------------


def run_tool(cmd: list[str], cwd: pathlib.Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert "Traceback" not in done.stderr, done.stderr
    assert "Traceback" not in done.stdout, done.stdout
    return done


@pytest.fixture
def flotilla(flotilla_exe: str, tmp_path: pathlib.Path):
    def run(*args: str) -> subprocess.CompletedProcess:
        return run_tool([flotilla_exe, *map(str, args)], tmp_path)

    return run


def assert_user_error(done: subprocess.CompletedProcess, *fragments: str, lines: int = 1) -> None:
    """A user mistake: exit 2, nothing on stdout, ``lines`` lines on stderr, the first ``flotilla: error:``."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stdout == ""
    err = done.stderr.rstrip("\n").split("\n")
    assert len(err) == lines, done.stderr
    assert err[0].startswith("flotilla: error: "), done.stderr
    for fragment in fragments:
        assert fragment in done.stderr, (fragment, done.stderr)


# --- dump ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_dump_text_prints_the_canonical_form(flotilla, tmp_path: pathlib.Path, form: str) -> None:
    program = build_two_block_program()
    path = write_program(program, tmp_path, "prog.bin", form)
    done = flotilla("dump", path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == format_program(program)
    assert done.stderr == ""


@pytest.mark.parametrize("form", FORMS)
def test_dump_one_block(flotilla, tmp_path: pathlib.Path, form: str) -> None:
    program = build_two_block_program()
    path = write_program(program, tmp_path, "prog", form)
    done = flotilla("dump", path, "--block", "1")
    assert done.returncode == 0, done.stderr
    assert done.stdout == format_block(program.blocks[1]) + "\n"
    assert "op square" in done.stdout and "op mul" not in done.stdout


def test_dump_json(flotilla, tmp_path: pathlib.Path) -> None:
    path = write_program(build_fc_program(), tmp_path, "prog.txt", "proto")
    done = flotilla("dump", path, "--format", "json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    text = json.dumps(doc)
    for name in ("fc_w", "fc_b", "mul", "elementwise_add", "mean"):
        assert name in text


def test_dump_dot(flotilla, tmp_path: pathlib.Path) -> None:
    program = build_fc_program()
    path = write_program(program, tmp_path, "prog.pb", "text")
    done = flotilla("dump", path, "--format", "dot")
    assert done.returncode == 0, done.stderr
    assert done.stdout == program_to_dot(program, block_idx=0)
    assert "digraph" in done.stdout and "mul" in done.stdout


def test_dump_bad_block_index(flotilla, tmp_path: pathlib.Path) -> None:
    path = write_program(build_two_block_program(), tmp_path, "prog", "text")
    assert_user_error(flotilla("dump", path, "--block", "7"), "no block 7", "2 block(s)")
    assert_user_error(flotilla("dump", path, "--block", "-1"), "no block -1")


# --- verify --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_verify_ok(flotilla, tmp_path: pathlib.Path, form: str) -> None:
    path = write_program(build_two_block_program(), tmp_path, "prog", form)
    done = flotilla("verify", path)
    assert (done.returncode, done.stdout, done.stderr) == (0, "ok: 2 blocks, 4 ops\n", "")


@pytest.mark.parametrize("form", FORMS)
def test_verify_reports_problems(flotilla, tmp_path: pathlib.Path, form: str) -> None:
    path = write_program(build_broken_program(), tmp_path, "prog", form)
    done = flotilla("verify", path)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "problem" in done.stdout
    assert "fc_w" in done.stdout
    assert not done.stdout.startswith("ok")


# --- diff ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form_a, form_b", [("text", "text"), ("text", "proto"), ("proto", "proto")])
def test_diff_identical(flotilla, tmp_path: pathlib.Path, form_a: str, form_b: str) -> None:
    a = write_program(build_fc_program(), tmp_path, "a", form_a)
    b = write_program(build_fc_program(), tmp_path, "b", form_b)
    done = flotilla("diff", a, b)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"identical: {a} and {b} (1 block(s), 3 ops)\n", "")


def test_diff_reports_variable_and_op_changes(flotilla, tmp_path: pathlib.Path) -> None:
    a = write_program(build_fc_program(), tmp_path, "a", "text")
    b = write_program(build_changed_program(), tmp_path, "b", "proto")
    done = flotilla("diff", a, b)
    assert done.returncode == 1, done.stderr
    out = done.stdout.splitlines()
    assert "block 0:" in out
    assert "  variables: 1 removed, 1 added, 1 changed" in out
    assert "    - param fc_b : lod_tensor<float32>[3]" in out
    assert "    + var sq : lod_tensor<float32>[1]" in out
    assert "    ~ param fc_w : lod_tensor<float32>[4, 3]" in out
    assert "      -> param fc_w : lod_tensor<float32>[4, 5]" in out
    assert "  ops: 3 -> 4" in out
    added_ops = [line for line in out if line.startswith("    +op ")]
    removed_ops = [line for line in out if line.startswith("    -op ")]
    assert len(added_ops) == 1 and added_ops[0].startswith("    +op square(X=[loss]) -> (Out=[sq])")
    assert removed_ops == []


def test_diff_reports_added_block(flotilla, tmp_path: pathlib.Path) -> None:
    a = write_program(build_fc_program(), tmp_path, "a", "proto")
    b = write_program(build_two_block_program(), tmp_path, "b", "text")
    done = flotilla("diff", a, b)
    assert done.returncode == 1, done.stderr
    assert "block 1: added (1 vars, 1 ops)" in done.stdout.splitlines()
    reverse = flotilla("diff", b, a)
    assert reverse.returncode == 1
    assert "block 1: removed (1 vars, 1 ops)" in reverse.stdout.splitlines()


def _fluid_model(hidden: int, act: str) -> Program:
    from flotilla import fluid

    main, startup = fluid.Program(), fluid.Program()
    with fluid.program_guard(main, startup):
        x = fluid.layers.data("x", shape=[4], dtype="float32")
        y = fluid.layers.data("y", shape=[1], dtype="float32")
        pred = fluid.layers.fc(fluid.layers.fc(x, size=hidden, act=act), size=1)
        fluid.optimizer.SGD(0.1).minimize(fluid.layers.mean(fluid.layers.square_error_cost(input=pred, label=y)))
    return main


def test_diff_aligns_programs_built_in_one_process_by_structure(flotilla, tmp_path: pathlib.Path) -> None:
    from flotilla.fluid import unique_name

    with unique_name.guard():  # names from fc_0 on, whatever ran before in this process
        first, second, changed = _fluid_model(8, "relu"), _fluid_model(8, "relu"), _fluid_model(8, "tanh")
    assert "fc_0.w_0" in first.global_block().vars and "fc_2.w_0" in second.global_block().vars
    a, b, c = (write_program(p, tmp_path, n, "proto") for p, n in ((first, "a"), (second, "b"), (changed, "c")))
    done = flotilla("diff", a, b)
    assert done.returncode == 1, done.stderr
    out = done.stdout.splitlines()
    assert len(out) == 4 and out[3] == "no other difference", done.stdout
    assert out[2].startswith(f"renamed by structure: 25 variable(s) of {b} compared under {a}'s names "
                             "(fc_2* -> fc_0*, fc_3* -> fc_1*, ")
    by_name = flotilla("diff", "--by-name", a, b)
    assert by_name.returncode == 1 and len(by_name.stdout.splitlines()) > 80  # what it was before aligning
    # a real change shows under A's names: only relu -> tanh, forward and backward
    out = flotilla("diff", a, c).stdout.splitlines()
    assert [line for line in out if line.startswith("    -op ")] == [
        "    -op relu(X=[fc_0.tmp_1]) -> (Out=[fc_0.tmp_2]) {op_role=0, op_role_var=[]}",
        "    -op relu_grad(X=[fc_0.tmp_1], Out@GRAD=[fc_0.tmp_2@GRAD]) -> (X@GRAD=[fc_0.tmp_1@GRAD]) "
        "{op_role=1, op_role_var=[]}"]
    assert [line[8:line.index("(")] for line in out if line.startswith("    +op ")] == ["tanh", "tanh_grad"]
    assert "variables:" not in done.stdout and not any("fc_4" in line for line in out[3:])


def test_diff_aligns_transpiled_programs_built_in_one_process(tmp_path: pathlib.Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Names in attributes (a pserver's grad_to_block_id, a gradient copy's copy_of) follow the renames."""
    from flotilla.cli import main
    from transpiler import DistributeTranspiler

    files = []
    for n in range(2):
        t = DistributeTranspiler()
        t.transpile(0, program=_fluid_model(8, "relu"), pservers="127.0.0.1:6174,127.0.0.1:6175", trainers=2)
        files.append((write_program(t.get_trainer_program(), tmp_path, f"trainer{n}", "proto"),
                      write_program(t.get_pserver_program("127.0.0.1:6174"), tmp_path, f"pserver{n}", "text")))
    for a, b in zip(*files):
        assert main(["diff", str(a), str(b)]) == 1
        out = capsys.readouterr().out.splitlines()
        assert len(out) == 4 and out[3] == "no other difference", out
        assert main(["diff", "--by-name", str(a), str(b)]) == 1
        assert len(capsys.readouterr().out.splitlines()) > 10  # by name, every variable differs


def test_diff_missing_second_file(flotilla, tmp_path: pathlib.Path) -> None:
    a = write_program(build_fc_program(), tmp_path, "a", "text")
    assert_user_error(flotilla("diff", a, tmp_path / "nope.txt"), "nope.txt", "no such file")


# --- graph ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_graph_dot(flotilla, tmp_path: pathlib.Path, form: str) -> None:
    program = build_two_block_program()
    path = write_program(program, tmp_path, "prog", form)
    out = tmp_path / "g.dot"
    done = flotilla("graph", path, "-o", out, "--block", "1")
    assert (done.returncode, done.stdout, done.stderr) == (0, f"wrote {out}: block 1 of {path} (1 ops)\n", "")
    assert out.read_text() == program_to_dot(program, block_idx=1)


def test_graph_svg_without_graphviz(tmp_path: pathlib.Path) -> None:
    path = write_program(build_fc_program(), tmp_path, "prog", "text")
    out = tmp_path / "g.svg"
    env = {**os.environ, "PATH": ""}
    done = run_tool([sys.executable, "-m", "flotilla.cli", "graph", str(path), "-o", str(out)], tmp_path, env)
    assert_user_error(done, "Graphviz's dot is not installed", ".dot")
    assert not out.exists()


def _fake_dot(folder: pathlib.Path, body: str) -> dict[str, str]:
    """A PATH holding only a fake ``dot`` (a Python script running ``body``)."""
    folder.mkdir()
    exe = folder / "dot"
    exe.write_text(f"#!{sys.executable}\nimport sys\nargs = sys.argv[1:]\n{body}\n")
    exe.chmod(0o755)
    return {**os.environ, "PATH": str(folder)}


def test_graph_svg_through_dot(tmp_path: pathlib.Path) -> None:
    env = _fake_dot(tmp_path / "bin", "data = sys.stdin.read()\n"
                                       "open(args[args.index('-o') + 1], 'w').write(args[0] + '\\n' + data)")
    program = build_fc_program()
    path = write_program(program, tmp_path, "prog", "proto")
    out = tmp_path / "g.svg"
    done = run_tool([sys.executable, "-m", "flotilla.cli", "graph", str(path), "-o", str(out)], tmp_path, env)
    assert (done.returncode, done.stderr) == (0, "")
    assert out.read_text() == "-Tsvg\n" + program_to_dot(program, block_idx=0)


def test_graph_dot_failure_is_one_line(tmp_path: pathlib.Path) -> None:
    env = _fake_dot(tmp_path / "bin", "sys.stderr.write('Error: syntax error in line 1\\n')\nsys.exit(3)")
    path = write_program(build_fc_program(), tmp_path, "prog", "text")
    done = run_tool([sys.executable, "-m", "flotilla.cli", "graph", str(path), "-o", str(tmp_path / "g.png")],
                    tmp_path, env)
    assert_user_error(done, "status 3", "syntax error in line 1")


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed on this machine")
def test_graph_svg_with_real_graphviz(flotilla, tmp_path: pathlib.Path) -> None:
    path = write_program(build_fc_program(), tmp_path, "prog", "text")
    out = tmp_path / "g.svg"
    done = flotilla("graph", path, "-o", out)
    assert done.returncode == 0, done.stderr
    assert "<svg" in out.read_text()


def test_graph_unknown_extension(flotilla, tmp_path: pathlib.Path) -> None:
    path = write_program(build_fc_program(), tmp_path, "prog", "text")
    assert_user_error(flotilla("graph", path, "-o", tmp_path / "g.jpeg"), "'.jpeg'", ".dot, .svg, .png")
    assert not (tmp_path / "g.jpeg").exists()


def test_graph_bad_block_index(flotilla, tmp_path: pathlib.Path) -> None:
    path = write_program(build_fc_program(), tmp_path, "prog", "proto")
    assert_user_error(flotilla("graph", path, "-o", tmp_path / "g.dot", "--block", "3"), "no block 3")
    assert not (tmp_path / "g.dot").exists()


def _training_files(folder: pathlib.Path) -> tuple[Program, pathlib.Path, pathlib.Path]:
    """A small training program (forward, backward, optimize ops) and its startup, written as protobuf."""
    from tests.transpiler.test_distribute_transpiler import build_fc

    main, startup = build_fc(sparse_emb=True)
    save_program(main, str(folder / "main.pb"))
    save_program(startup, str(folder / "startup.pb"))
    return main, folder / "main.pb", folder / "startup.pb"


@pytest.mark.parametrize("flags,roles,ops_only", [
    (["--role", "backward"], ["backward"], False),
    (["--role", "forward", "--role", "optimize", "--ops-only"], ["forward", "optimize"], True),
    (["--ops-only"], None, True),
])
def test_graph_role_and_ops_only_filters(flotilla, tmp_path: pathlib.Path, flags: list[str], roles: list[str] | None,
                                         ops_only: bool) -> None:
    program, path, _ = _training_files(tmp_path)
    out = tmp_path / "g.dot"
    done = flotilla("graph", path, "-o", out, *flags)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"wrote {out}: block 0 of {path} (18 ops)\n", "")
    assert out.read_text() == program_to_dot(program, roles=roles, ops_only=ops_only)


def test_graph_unknown_role(flotilla, tmp_path: pathlib.Path) -> None:
    path = write_program(build_fc_program(), tmp_path, "prog", "text")
    assert_user_error(flotilla("graph", path, "-o", tmp_path / "g.dot", "--role", "fwd"), "--role", "'forward'")


def test_graph_job_draws_the_transpiled_job(flotilla, tmp_path: pathlib.Path) -> None:
    from ir.export import job_to_dot
    from ir.serialize import load_program

    _, main, startup = _training_files(tmp_path)
    job = tmp_path / "job"
    done = flotilla("transpile", main, "--startup", startup, "--pservers", "127.0.0.1:6174,127.0.0.1:6175",
                    "--trainers", "2", "-o", job)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "job.dot"
    done = flotilla("graph", "--job", job, "-o", out)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"wrote {out}: the job in {job} (4 roles)\n", "")
    roles = ["trainer.0", "trainer.1", "pserver@127.0.0.1_6174", "pserver@127.0.0.1_6175"]
    expected = job_to_dot({r: load_program(str(job / f"{r}.main.pb")) for r in roles})
    assert out.read_text() == expected
    assert 'label="pserver 127.0.0.1:6174"' in expected and "no block applies" not in expected


def test_graph_job_mistakes(flotilla, tmp_path: pathlib.Path) -> None:
    path = write_program(build_fc_program(), tmp_path, "prog", "text")
    assert_user_error(flotilla("graph", "--job", path, "-o", tmp_path / "j.dot"), "not a directory")
    (tmp_path / "empty").mkdir()
    assert_user_error(flotilla("graph", "--job", tmp_path / "empty", "-o", tmp_path / "j.dot"), "no ROLE.main.pb")
    assert_user_error(flotilla("graph", "--job", tmp_path / "empty", "--role", "rpc", "-o", tmp_path / "j.dot"),
                      "--job draws the whole job")


# --- reading files: user mistakes ----------------------------------------------------------------------


@pytest.mark.parametrize("command", [["dump"], ["verify"], ["graph", "-o", "g.dot"]])
def test_missing_file(flotilla, tmp_path: pathlib.Path, command: list[str]) -> None:
    assert_user_error(flotilla(command[0], tmp_path / "absent.txt", *command[1:]), "absent.txt", "no such file")


def test_directory_instead_of_file(flotilla, tmp_path: pathlib.Path) -> None:
    assert_user_error(flotilla("dump", tmp_path), "is a directory")


def test_binary_garbage(flotilla, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "garbage.pb"
    path.write_bytes(bytes(range(256)) * 4)
    assert_user_error(flotilla("verify", path), "garbage.pb", "not a Flotilla program")


def test_truncated_protobuf(flotilla, tmp_path: pathlib.Path) -> None:
    data = program_to_bytes(build_fc_program())
    path = tmp_path / "cut.txt"
    path.write_bytes(data[: len(data) // 2])
    assert_user_error(flotilla("dump", path), "cut.txt")


def test_parse_error_shows_location_and_caret(flotilla, tmp_path: pathlib.Path) -> None:
    text = format_program(build_fc_program()).replace("op mean(", "op mean X=(", 1)
    path = tmp_path / "bad.txt"
    path.write_text(text)
    line_no = text.splitlines().index(next(line for line in text.splitlines() if "op mean X=(" in line)) + 1
    done = flotilla("dump", path)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    first = done.stderr.splitlines()[0]
    assert first.startswith(f"flotilla: error: {path}:{line_no}:"), done.stderr
    assert "op mean X=(" in done.stderr  # the source line
    assert "^" in done.stderr  # the caret


def test_text_garbage_is_a_parse_error(flotilla, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello, this is not a program\n")
    done = flotilla("verify", path)
    assert done.returncode == 2
    assert done.stderr.startswith(f"flotilla: error: {path}:1:"), done.stderr


def test_empty_file(flotilla, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "empty"
    path.write_bytes(b"")
    done = flotilla("dump", path)
    assert done.returncode == 2
    assert done.stderr.startswith("flotilla: error: "), done.stderr


# --- arguments -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, fragment",
    [
        ([], "required"),
        (["frobnicate"], "frobnicate"),
        (["dump"], "PROGRAM"),
        (["dump", "p.txt", "--format", "xml"], "xml"),
        (["dump", "p.txt", "--block", "one"], "one"),
        (["graph", "p.txt"], "-o"),
        (["diff", "p.txt"], "B"),
    ],
)
def test_bad_arguments(flotilla, args: list[str], fragment: str) -> None:
    assert_user_error(flotilla(*args), fragment, "--help")


def test_help_lists_every_subcommand(flotilla) -> None:
    from flotilla.cli import COMMANDS

    done = flotilla("--help")
    assert done.returncode == 0
    assert {"launch", "transpile", "plan", "memory"} <= set(COMMANDS)
    described = done.stdout.split("positional arguments")[0]  # the description names every command too
    for name in COMMANDS:
        assert f"\n    {name}" in done.stdout and name in described, name


def test_version_is_the_package_version(flotilla) -> None:
    import importlib.metadata
    import re

    done = flotilla("--version")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"flotilla {importlib.metadata.version('flotilla')}\n"
    pyproject = (pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert done.stdout.split()[1] == re.search(r'^version = "(.+)"', pyproject, re.MULTILINE).group(1)


def test_version_falls_back_to_pyproject(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    from flotilla import cli

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    pyproject = (pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert f'\nversion = "{cli.version()}"\n' in pyproject


def test_transpile_help_describes_nccl2(flotilla) -> None:
    done = flotilla("transpile", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "nccl2: Fluid's nccl2 mode" in text and "allreduce" in text and "--trainers lists every" in text
    top = " ".join(flotilla("--help").stdout.split())
    assert "(--mode nccl2|collective)" in top


def test_in_process_main_matches(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    from flotilla.cli import main

    program = build_fc_program()
    path = write_program(program, tmp_path, "prog", "proto")
    assert main(["dump", str(path)]) == 0
    assert capsys.readouterr().out == format_program(program)
    assert main(["dump", str(tmp_path / "absent")]) == 2
    assert capsys.readouterr().err.startswith("flotilla: error: ")
