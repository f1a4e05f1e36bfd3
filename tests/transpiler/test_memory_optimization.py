"""The memory transpiler API (``transpiler.memory_optimize`` / ``release_memory``): in place, the report
and ``print_log``, bad arguments, ``skip_grads`` before the pserver transpile, unchanged training
numerics on the Executor (which folds ``delete_var`` into its compiled runs), and ``flotilla memory``."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ir.core import Program
from ir.printer import format_program
from ir.serialize import save_program
from ir.verify import collect_problems
from tests.passes.memory_models import mlp, used_names
from transpiler import DistributeTranspiler, MemoryOptimizeError, MemoryReport, memory_optimize, release_memory
from flotilla.cli import main as cli_main

EPS2 = "127.0.0.1:6174,127.0.0.1:6175"


def test_memory_optimize_works_in_place_and_reports(capsys: pytest.CaptureFixture[str]) -> None:
    main, _, _ = mlp((4, 4))
    before = len(used_names(main))
    report = memory_optimize(main, print_log=True, batch_size=8)
    assert isinstance(report, MemoryReport)
    assert len(used_names(main)) == before - report.variables_reused > 0
    assert report.bytes_saved > 0 and report.batch_size == 8
    out = capsys.readouterr().out
    assert out.splitlines()[0] == report.lines()[0]
    assert out.startswith("memory_optimize level 0: 8 variable(s) reused")
    assert memory_optimize(main).variables_reused == 0  # nothing left to reuse


def test_release_memory_in_place_and_print_log(capsys: pytest.CaptureFixture[str]) -> None:
    main, _, _ = mlp((4, 4))
    report = release_memory(main, print_log=True)
    assert report.deleted and sum(op.type == "delete_var" for op in main.global_block().ops) == len(report.deleted)
    assert capsys.readouterr().out.startswith("release_memory: 0 variable(s) reused")


@pytest.mark.parametrize("call, code", [
    (lambda p: memory_optimize(p, level=2), "E660"),
    (lambda p: memory_optimize(p, level="0"), "E660"),
    (lambda p: memory_optimize(p, skip_opt_set="fc_0.tmp_0"), "E661"),
    (lambda p: memory_optimize(p, skip_opt_set=[None]), "E661"),
    (lambda p: memory_optimize(p, print_log="yes"), "E664"),
    (lambda p: memory_optimize(p, skip_grads=1), "E664"),
    (lambda p: memory_optimize(format_program(p)), "E662"),
    (lambda p: release_memory(p, skip_opt_set=3.5), "E661"),
    (lambda p: release_memory(None), "E662"),
])
def test_bad_arguments_raise_and_modify_nothing(call: Any, code: str) -> None:
    main, _, _ = mlp((4, 4))
    text = format_program(main)
    with pytest.raises(MemoryOptimizeError) as e:
        call(main)
    assert e.value.code == code and e.value.message
    assert format_program(main) == text


def test_skip_opt_set_accepts_variables_and_lists() -> None:
    main, _, _ = mlp((4, 4))
    keep = main.global_block().var("fc_1.tmp_2")
    report = memory_optimize(main, skip_opt_set=[keep, "fc_1.tmp_1"])
    assert all({r.var, r.onto}.isdisjoint({"fc_1.tmp_2", "fc_1.tmp_1"}) for r in report.reused)
    assert {"fc_1.tmp_2", "fc_1.tmp_1"} <= used_names(main)


# --- before the pserver transpile -------------------------------------------------------------------------


def _sent_params(trainer: Program) -> set[str]:
    """The parameters whose gradient a trainer sends (each ``send`` records ``op_role_var = [param, grad]``)."""
    return {op.role_var[0] for op in trainer.global_block().ops if op.type == "send" and op.role_var}


@pytest.mark.parametrize("level", [0, 1])
def test_skip_grads_then_pserver_transpile_sends_every_gradient(level: int) -> None:
    plain, startup, _ = mlp((16, 16), opt="adam")
    optimized = plain.clone()
    report = memory_optimize(optimized, skip_grads=True, level=level)
    assert report.reused
    results = []
    for main in (plain, optimized):
        t = DistributeTranspiler()
        t.transpile(0, program=main, pservers=EPS2, trainers=2, startup_program=startup)
        trainer = t.get_trainer_program(wait_port=False)
        assert {pp.grad for pp in t.plan.params} == {"w0@GRAD", "b0@GRAD", "w1@GRAD", "b1@GRAD", "wo@GRAD", "bo@GRAD"}
        assert _sent_params(trainer) == {pp.param for pp in t.plan.params} == {"w0", "b0", "w1", "b1", "wo", "bo"}
        assert collect_problems(trainer) == []
        results.append(t)
    for ep in EPS2.split(","):
        assert format_program(results[0].get_pserver_program(ep)) == format_program(results[1].get_pserver_program(ep))


# --- numerics on the Executor ---------------------------------------------------------------------------------


def _train(kind: str, steps: int = 5) -> tuple[list[np.ndarray], dict[str, np.ndarray], int]:
    import runtime

    main, startup, loss = mlp((16, 16, 16), opt="adam")
    if kind in ("level0", "level0+release"):
        memory_optimize(main, level=0)
    if kind == "level1":
        memory_optimize(main, level=1)
    if kind in ("release", "level0+release"):
        release_memory(main)
    scope, exe = runtime.Scope(), runtime.Executor()
    exe.run(startup, scope=scope)
    rng = np.random.default_rng(7)
    losses = []
    for _ in range(steps):
        feed = {"x": rng.normal(size=(32, 8)).astype("float32"), "y": rng.normal(size=(32, 1)).astype("float32")}
        losses.append(exe.run(main, feed=feed, fetch_list=[loss], scope=scope)[0])
    params = {p.name: np.array(scope.numpy(p.name)) for p in main.all_parameters()}
    runs = sum(type(step).__name__ == "_PureRun" for plan in exe._plans[main].values() for step in plan.steps)
    return losses, params, runs


def test_training_numerics_identical_for_every_rewrite() -> None:
    """Same-shaped hidden layers, 5 Adam steps: identical losses and parameters, bit for bit, and the
    release_memory program still runs as one compiled run."""
    want_losses, want_params, want_runs = _train("plain")
    assert want_runs == 1
    for kind in ("level0", "level1", "release", "level0+release"):
        losses, params, runs = _train(kind)
        assert runs == 1, kind
        np.testing.assert_array_equal(np.array(losses), np.array(want_losses), err_msg=kind)
        for name, value in want_params.items():
            np.testing.assert_array_equal(params[name], value, err_msg=f"{kind}: {name}")


def test_executor_drops_deleted_values_across_a_host_op(tmp_path: Any) -> None:
    """A delete_var after a host op is a host step; one that ends a run is folded into it; a deleted value
    is gone from the scope and cannot be fetched."""
    import runtime

    p = Program()
    b = p.global_block()
    b.create_var("x", (2, 3), is_data=True)
    for n in ("a", "c", "d"):
        b.create_var(n, (2, 3))
    b.append_op("relu", {"X": ["x"]}, {"Out": ["a"]})
    b.append_op("save", {"X": ["a"]}, attrs={"file_path": str(tmp_path / "a.bin")})
    b.append_op("delete_var", {"X": ["x"]}, infer_shape=False)
    b.append_op("scale", {"X": ["a"]}, {"Out": ["c"]}, {"scale": 2.0})
    b.append_op("delete_var", {"X": ["a"]}, infer_shape=False)
    b.append_op("relu", {"X": ["c"]}, {"Out": ["d"]})
    exe, scope = runtime.Executor(), runtime.Scope()
    feed = {"x": np.arange(6, dtype="float32").reshape(2, 3) - 2}
    (d,) = exe.run(p, feed=feed, fetch_list=["d"], scope=scope)
    np.testing.assert_array_equal(d, 2 * np.maximum(feed["x"], 0))
    steps = [type(s).__name__ for plan in exe._plans[p].values() for s in plan.steps]
    assert steps == ["_PureRun", "_HostStep", "_HostStep", "_PureRun", "_HostStep"]
    with pytest.raises(Exception, match="was not computed"):
        exe.run(p, feed=feed, fetch_list=["a"], scope=scope)


# --- flotilla memory ------------------------------------------------------------------------------------------


def test_cli_memory(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    main, _, _ = mlp((4, 8))
    path = tmp_path / "mlp.pb"
    save_program(main, str(path))
    out_path = tmp_path / "opt.txt"
    assert cli_main(["memory", str(path), "--level", "1", "--skip-grads", "--batch-size", "32",
                     "-o", str(out_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = memory_optimize(main, level=1, skip_grads=True, batch_size=32)
    assert lines[0] == (f"{path}: memory_optimize level 1 (skip grads): peak live bytes (liveness estimate, batch 32) "
                        f"{expected.bytes_before} -> {expected.bytes_after} (saved {expected.bytes_saved}, "
                        f"{100.0 * expected.bytes_saved / expected.bytes_before:.1f}%); "
                        f"{expected.variables_reused} variable(s) reused")
    assert lines[1:-1] == ["  " + r.line() for r in expected.reused]
    assert out_path.read_text() == format_program(main)


@pytest.mark.parametrize("argv, message", [
    (["memory", "/nonexistent/p.txt"], "no such file"),
    (["memory", "PROGRAM", "--level", "2"], "invalid choice"),
    (["memory", "PROGRAM", "--batch-size", "0"], "--batch-size 0"),
    (["memory", "PROGRAM", "--skip", "y", "-o", "/nonexistent/dir/o.txt"], "cannot write"),
])
def test_cli_memory_errors_are_one_line(argv: list[str], message: str, tmp_path: Any,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    main, _, _ = mlp((4,))
    path = tmp_path / "p.txt"
    path.write_text(format_program(main))
    assert cli_main([str(path) if a == "PROGRAM" else a for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flotilla: error: ") and message in err and len(err.strip().splitlines()) == 1
