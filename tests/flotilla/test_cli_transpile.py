"""End-to-end tests of ``flotilla transpile`` and ``flotilla plan`` (the installed executable, in a
subprocess): the files written, their agreement with the in-process façade, the plan's table, DOT and
PNG forms, and every user mistake (one ``flotilla: error:`` line, exit 2, no traceback).
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from typing import Any, Callable, Iterator

import pytest

import ir
from flotilla.fluid import layers, optimizer
from flotilla.fluid.param_attr import ParamAttr
from ir.core import Program
from ir.printer import format_program
from ir.serialize import load_program, save_program
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, HashName
from flotilla.cli import role_file_stem

TIMEOUT_S = 60
REPO = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore:pserver .* holds no parameter block")
EP0, EP1, EP2 = "127.0.0.1:6174", "127.0.0.1:6175", "127.0.0.1:6176"


@pytest.fixture(autouse=True)
def fresh_names() -> Iterator[None]:
    with ir.unique_name.guard():
        yield


# --- programs ------------------------------------------------------------------------------------------


def build_fc(make_opt: Callable[[], Any] | None = lambda: optimizer.SGD(0.1)) -> tuple[Program, Program]:
    """TestBasicModel's network (fc_w 1000×1000, fc_b 1000); without an optimizer when make_opt is None."""
    main, startup = Program(), Program()
    with ir.program_guard(main, startup):
        x = layers.data("x", [1000])
        y = layers.data("y", [1000])
        pred = layers.fc(x, 1000, param_attr=ParamAttr(name="fc_w"), bias_attr=ParamAttr(name="fc_b"))
        loss = layers.mean(layers.square_error_cost(pred, y))
        if make_opt is not None:
            make_opt().minimize(loss)
    return main, startup


@pytest.fixture
def fc_files(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """The fc model saved as protobuf (main) and text (startup)."""
    main, startup = build_fc()
    save_program(main, tmp_path / "main.pb")
    (tmp_path / "startup.txt").write_text(format_program(startup))
    return tmp_path / "main.pb", tmp_path / "startup.txt"


def reference(main_path: pathlib.Path, startup_path: pathlib.Path, trainer_id: int = 0, pservers: str = f"{EP0},{EP1}",
              trainers: int = 2, sync_mode: bool = True,
              config: DistributeTranspilerConfig | None = None) -> DistributeTranspiler:
    """The same transpile, in process, from the same files."""
    t = DistributeTranspiler(config)
    t.transpile(trainer_id, program=load_program(main_path), pservers=pservers, trainers=trainers,
                sync_mode=sync_mode, startup_program=ir.parse_program(startup_path.read_text()))
    return t


# --- running the tool ----------------------------------------------------------------------------------


def run_tool(cmd: list[str], cwd: pathlib.Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # The tool runs this checkout's packages, whichever copy the `flotilla` script was installed from.
    env = {**(env if env is not None else os.environ), "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert "Traceback" not in done.stderr, done.stderr
    assert "Traceback" not in done.stdout, done.stdout
    return done


@pytest.fixture
def flotilla(flotilla_exe: str, tmp_path: pathlib.Path) -> Callable[..., subprocess.CompletedProcess]:
    def run(*args: Any) -> subprocess.CompletedProcess:
        return run_tool([flotilla_exe, *map(str, args)], tmp_path)

    return run


def assert_user_error(done: subprocess.CompletedProcess, *fragments: str) -> None:
    """A user mistake: exit 2, nothing on stdout, one ``flotilla: error:`` line on stderr."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stdout == ""
    err = done.stderr.rstrip("\n").split("\n")
    assert len(err) == 1, done.stderr
    assert err[0].startswith("flotilla: error: "), done.stderr
    for fragment in fragments:
        assert fragment in done.stderr, (fragment, done.stderr)


def inputs(files: tuple[pathlib.Path, pathlib.Path], pservers: str = f"{EP0},{EP1}", trainers: int = 2) -> list[str]:
    return [str(files[0]), "--startup", str(files[1]), "--pservers", pservers, "--trainers", str(trainers)]


# --- transpile -----------------------------------------------------------------------------------------


def test_role_file_stem() -> None:
    assert role_file_stem("trainer.0") == "trainer.0"
    assert role_file_stem(f"pserver@{EP0}") == "pserver@127.0.0.1_6174"
    assert role_file_stem("pserver@[::1]:80") == "pserver@___1__80"


def test_transpile_writes_every_role(flotilla, fc_files, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    done = flotilla("transpile", *inputs(fc_files), "-o", out)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    stems = ["trainer.0", "trainer.1", "pserver@127.0.0.1_6174", "pserver@127.0.0.1_6175"]
    expected = sorted(f"{s}.{kind}.{ext}" for s in stems for kind in ("main", "startup") for ext in ("pb", "txt"))
    assert sorted(os.listdir(out)) == expected
    lines = done.stdout.splitlines()
    assert lines[0] == f"transpiled {fc_files[0]}: 2 pserver(s), 2 trainer(s), sync, round_robin, min_block_size 8192"
    assert lines[-1] == f"wrote 16 files to {out}"
    assert "  pserver@127.0.0.1:6174: main 3 block(s), 7 ops; startup 1 block(s), 3 ops -> " \
           "pserver@127.0.0.1_6174.{main,startup}.{pb,txt}" in lines
    for trainer_id in (0, 1):
        t = reference(*fc_files, trainer_id=trainer_id)
        roles = {f"trainer.{trainer_id}": (t.get_trainer_program(wait_port=False), t.get_trainer_startup_program())}
        if trainer_id == 0:
            roles.update({f"pserver@{ep}": t.get_pserver_programs(ep) for ep in (EP0, EP1)})
        for role, (main, startup) in roles.items():
            stem = role_file_stem(role)
            for kind, program in (("main", main), ("startup", startup)):
                text = format_program(program)
                assert (out / f"{stem}.{kind}.txt").read_text() == text, (role, kind)
                assert format_program(load_program(out / f"{stem}.{kind}.pb")) == text, (role, kind)


def test_transpile_one_trainer_async_hash_name(flotilla, fc_files, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    done = flotilla("transpile", *inputs(fc_files, f"{EP0},{EP1},{EP2}", 4), "--trainer-id", "3", "--async",
                    "--split-method", "hash_name", "-o", out)
    assert done.returncode == 0, done.stderr
    assert sorted({name.split(".main")[0].split(".startup")[0] for name in os.listdir(out)}) == [
        "pserver@127.0.0.1_6174", "pserver@127.0.0.1_6175", "pserver@127.0.0.1_6176", "trainer.3"]
    t = reference(*fc_files, trainer_id=3, pservers=f"{EP0},{EP1},{EP2}", trainers=4, sync_mode=False,
                  config=DistributeTranspilerConfig(split_method=HashName))
    trainer = (out / "trainer.3.main.txt").read_text()
    assert trainer == format_program(t.get_trainer_program(wait_port=False))
    assert "send_barrier" not in trainer  # async
    for ep in (EP0, EP1, EP2):
        assert (out / f"{role_file_stem('pserver@' + ep)}.main.txt").read_text() == \
            format_program(t.get_pserver_program(ep))


def test_transpile_no_slice_and_min_block_size(flotilla, fc_files, tmp_path: pathlib.Path) -> None:
    for flags, sliced in ((["--no-slice"], False), (["--min-block-size", "2000000"], False),
                          (["--min-block-size", "1"], True)):
        out = tmp_path / f"out{len(flags)}{flags[-1]}"
        done = flotilla("transpile", *inputs(fc_files), *flags, "-o", out)
        assert done.returncode == 0, done.stderr
        texts = "".join(p.read_text() for p in sorted(out.glob("pserver*.main.txt")))
        assert ("fc_w.block0" in texts) is sliced, flags
        assert ("fc_w.block1" in texts) is sliced, flags


def test_transpile_empty_pserver_warns(flotilla, fc_files, tmp_path: pathlib.Path) -> None:
    # fc_w is a single block with --no-slice: 2 params on 3 pservers leaves one with nothing.
    done = flotilla("transpile", *inputs(fc_files, f"{EP0},{EP1},{EP2}"), "--no-slice", "-o", tmp_path / "out")
    assert done.returncode == 0
    assert done.stderr.startswith("flotilla: warning: "), done.stderr
    assert "127.0.0.1:6176" in done.stderr


# --- plan ----------------------------------------------------------------------------------------------

PLAN_TEXT_3 = """\
plan: 3 pserver(s), 2 trainer(s), sync, min_block_size 8192

param  block        rows         shape          bytes  endpoint
fc_b   fc_b         [0, 1000)    [1000]          4000  127.0.0.1:6174
fc_w   fc_w.block0  [0, 334)     [334, 1000]  1336000  127.0.0.1:6175
fc_w   fc_w.block1  [334, 668)   [334, 1000]  1336000  127.0.0.1:6176
fc_w   fc_w.block2  [668, 1000)  [332, 1000]  1328000  127.0.0.1:6174

endpoint        blocks    bytes
127.0.0.1:6174       2  1332000
127.0.0.1:6175       1  1336000
127.0.0.1:6176       1  1336000

total 4004000 bytes in 4 block(s); balance (max/mean bytes per pserver): 1.001
"""


def test_plan_text(flotilla, fc_files) -> None:
    done = flotilla("plan", *inputs(fc_files, f"{EP0},{EP1},{EP2}"))
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == PLAN_TEXT_3


def test_plan_matches_the_facade(flotilla, fc_files) -> None:
    done = flotilla("plan", *inputs(fc_files), "--split-method", "hash_name")
    assert done.returncode == 0, done.stderr
    plan = reference(*fc_files, config=DistributeTranspilerConfig(split_method=HashName)).plan
    placed = [(b.name, ep) for pp in plan.params for b, _, ep in pp.blocks()]
    rows = [line.split() for line in done.stdout.splitlines()[3:3 + len(placed)]]
    assert [(r[1], r[-1]) for r in rows] == placed


def test_plan_balance_unbalanced(flotilla, fc_files) -> None:
    # No slicing: fc_w (4 MB) on 6174, fc_b (4 kB) on 6175; mean 2002000, max 4000000.
    done = flotilla("plan", *inputs(fc_files), "--no-slice")
    assert done.returncode == 0
    assert done.stdout.splitlines()[-1] == \
        "total 4004000 bytes in 2 block(s); balance (max/mean bytes per pserver): 1.998"


def test_plan_dot(flotilla, fc_files, tmp_path: pathlib.Path) -> None:
    done = flotilla("plan", *inputs(fc_files), "--format", "dot")
    assert done.returncode == 0, done.stderr
    dot = done.stdout
    assert dot.startswith("digraph plan {\n") and dot.endswith("}\n")
    assert '"param:fc_w" [shape=ellipse, label="fc_w\\n[1000, 1000]"];' in dot
    assert '"param:fc_w" -> "pserver:127.0.0.1:6175" [label="fc_w.block0\\nrows [0, 500), 2000000 B"];' in dot
    assert '"pserver:127.0.0.1:6174" [shape=box, label="127.0.0.1:6174\\n2 block(s), 2004000 bytes"];' in dot
    out = tmp_path / "plan.dot"
    again = flotilla("plan", *inputs(fc_files), "--format", "dot", "--output", out)
    assert (again.returncode, again.stdout) == (0, "")
    assert out.read_text() == dot


def _fake_dot(folder: pathlib.Path) -> dict[str, str]:
    """A PATH holding only a fake ``dot`` that writes its -T flag and its input to the -o file."""
    folder.mkdir()
    exe = folder / "dot"
    exe.write_text(f"#!{sys.executable}\nimport sys\nargs = sys.argv[1:]\ndata = sys.stdin.read()\n"
                   "open(args[args.index('-o') + 1], 'w').write(args[0] + '\\n' + data)\n")
    exe.chmod(0o755)
    return {**os.environ, "PATH": str(folder)}


def test_plan_png_through_dot(fc_files, tmp_path: pathlib.Path) -> None:
    env = _fake_dot(tmp_path / "bin")
    out = tmp_path / "plan.png"
    cmd = [sys.executable, "-m", "flotilla.cli", "plan", *inputs(fc_files)]
    done = run_tool([*cmd, "--format", "png", "--output", str(out)], tmp_path, env)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    dot = run_tool([*cmd, "--format", "dot"], tmp_path, env).stdout
    assert out.read_text() == "-Tpng\n" + dot


def test_plan_png_without_graphviz(fc_files, tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "PATH": ""}
    out = tmp_path / "plan.png"
    done = run_tool([sys.executable, "-m", "flotilla.cli", "plan", *inputs(fc_files), "--format", "png",
                     "--output", str(out)], tmp_path, env)
    assert_user_error(done, "Graphviz's dot is not installed", "--format dot")
    assert not out.exists()


def test_plan_png_needs_output(flotilla, fc_files) -> None:
    assert_user_error(flotilla("plan", *inputs(fc_files), "--format", "png"), "--format png needs --output")


# --- user mistakes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["transpile", "plan"])
@pytest.mark.parametrize(
    "pservers, fragment",
    [
        ("", "pservers is empty"),
        ("127.0.0.1", "'127.0.0.1' is malformed"),
        ("127.0.0.1:0", "'127.0.0.1:0' is malformed"),
        ("127.0.0.1:70000", "'127.0.0.1:70000' is malformed"),
        (":1", "':1' is malformed"),
        (f"{EP0},{EP0}", "more than once"),
    ],
)
def test_bad_endpoints(flotilla, fc_files, tmp_path: pathlib.Path, command: str, pservers: str, fragment: str) -> None:
    extra = ["-o", tmp_path / "out"] if command == "transpile" else []
    assert_user_error(flotilla(command, *inputs(fc_files, pservers), *extra), fragment, "hint:")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--trainer-id", "2"], "--trainer-id 2 is out of range: expected 0..1"),
        (["--trainer-id", "-1"], "--trainer-id -1 is out of range"),
        (["--min-block-size", "0"], "min_block_size must be an int >= 1, got 0"),
        (["--split-method", "random"], "'random'"),
    ],
)
def test_bad_options(flotilla, fc_files, tmp_path: pathlib.Path, args: list[str], fragment: str) -> None:
    assert_user_error(flotilla("transpile", *inputs(fc_files), *args, "-o", tmp_path / "out"), fragment)
    assert_user_error(flotilla("plan", *inputs(fc_files), *args), fragment)


@pytest.mark.parametrize("trainers, fragment", [("0", "--trainers 0: expected at least 1"),
                                                ("two", "--trainers 'two': expected the number of trainers")])
def test_bad_trainers(flotilla, fc_files, tmp_path: pathlib.Path, trainers: str, fragment: str) -> None:
    args = [str(fc_files[0]), "--startup", str(fc_files[1]), "--pservers", EP0, "--trainers", trainers]
    assert_user_error(flotilla("transpile", *args, "-o", tmp_path / "out"), fragment)


def test_missing_files(flotilla, fc_files, tmp_path: pathlib.Path) -> None:
    absent = tmp_path / "absent.pb"
    assert_user_error(flotilla("transpile", *inputs((absent, fc_files[1])), "-o", tmp_path / "o"),
                      "absent.pb", "no such file")
    assert_user_error(flotilla("plan", *inputs((fc_files[0], absent))), "absent.pb", "no such file")


def test_program_without_optimizer(flotilla, tmp_path: pathlib.Path) -> None:
    main, startup = build_fc(None)
    save_program(main, tmp_path / "fwd.pb")
    save_program(startup, tmp_path / "fwd_startup.pb")
    files = (tmp_path / "fwd.pb", tmp_path / "fwd_startup.pb")
    assert_user_error(flotilla("transpile", *inputs(files), "-o", tmp_path / "out"), "no optimizer ops", "hint:")
    assert_user_error(flotilla("plan", *inputs(files)), "no optimizer ops")
    assert not (tmp_path / "out").exists()


def test_output_is_a_file(flotilla, fc_files, tmp_path: pathlib.Path) -> None:
    target = tmp_path / "taken"
    target.write_text("x")
    assert_user_error(flotilla("transpile", *inputs(fc_files), "-o", target), "exists and is not a directory")


@pytest.mark.parametrize("missing", ["--startup", "--pservers", "--trainers"])
def test_required_arguments(flotilla, fc_files, missing: str) -> None:
    args = inputs(fc_files)
    i = args.index(missing)
    del args[i:i + 2]
    # --pservers is required only in pserver mode (the default), so the tool checks it itself
    assert_user_error(flotilla("plan", *args), missing, *(["--help"] if missing != "--pservers" else []))


def test_help_lists_the_new_commands(flotilla) -> None:
    done = flotilla("--help")
    assert done.returncode == 0
    assert "transpile" in done.stdout and "plan" in done.stdout


def test_transpile_nccl2(flotilla, fc_files, tmp_path: pathlib.Path) -> None:
    trainers = f"{EP0},127.0.0.1:6180"
    done = flotilla("transpile", str(fc_files[0]), "--startup", str(fc_files[1]), "--mode", "nccl2",
                    "--trainers", trainers, "--fuse-grad-size-mb", "0", "-o", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert "nccl2 (grad_allreduce), 2 trainer(s)" in done.stdout
    startup = (tmp_path / "out" / "trainer.1.startup.txt").read_text()
    main = (tmp_path / "out" / "trainer.1.main.txt").read_text()
    assert "op gen_nccl_id()" in startup and "c_broadcast" in startup
    assert main.count("op c_allreduce_sum(") == 2  # fc_w and fc_b, one collective each
    assert not list((tmp_path / "out").glob("pserver*"))


def test_transpile_hybrid(flotilla, tmp_path: pathlib.Path) -> None:
    from tests.passes.ctr_model import build_ctr

    main, startup = build_ctr()
    save_program(main, tmp_path / "main.pb")
    save_program(startup, tmp_path / "startup.pb")
    done = flotilla("transpile", str(tmp_path / "main.pb"), "--startup", str(tmp_path / "startup.pb"), "--mode",
                    "hybrid", "--pservers", EP0, "--trainers", "127.0.0.1:6180,127.0.0.1:6181", "-o", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert "hybrid, 1 pserver(s) holding the distributed table (sync), 2 trainer(s)" in done.stdout
    main_text = (tmp_path / "out" / "trainer.1.main.txt").read_text()
    assert "op c_allreduce_sum(" in main_text and "op prefetch(" in main_text and "op recv(" not in main_text
    assert "op gen_nccl_id()" in (tmp_path / "out" / "trainer.1.startup.txt").read_text()
    assert "op listen_and_serv(" in (tmp_path / "out" / "pserver@127.0.0.1_6174.main.txt").read_text()


@pytest.mark.parametrize("args, fragment", [
    (["--mode", "nccl2", "--trainers", "2"], "--mode nccl2 needs every trainer's endpoint"),
    (["--mode", "hybrid", "--trainers", "127.0.0.1:6180,127.0.0.1:6181"], "--pservers is required in hybrid mode"),
    (["--mode", "hybrid", "--pservers", EP0, "--trainers", "2"], "--mode hybrid needs every trainer's endpoint"),
    (["--trainers", "2"], "--pservers is required in pserver mode"),
])
def test_transpile_mode_errors(flotilla, fc_files, tmp_path: pathlib.Path, args: list[str], fragment: str) -> None:
    assert_user_error(flotilla("transpile", str(fc_files[0]), "--startup", str(fc_files[1]), *args,
                               "-o", tmp_path / "out"), fragment)
