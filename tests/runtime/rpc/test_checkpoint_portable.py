"""Checkpoints of real pserver jobs (issue 21): saved anywhere the job names, loaded anywhere.

A trainer names its checkpoint by an absolute path without any checkpoint root, as in Fluid; the files
land there and load back into the pservers. A checkpoint of a 2-pserver job (a sliced fc_w, a
distributed table, Adam's accumulators) loads into the single-machine program, whole.
"""
from __future__ import annotations

import argparse
import os
import pathlib
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from runtime import io
from runtime.x64 import x64
from tests.runtime.rpc import ps_worker
from tests.runtime.rpc.test_ps_training import clusters  # noqa: F401 (fixture)
from tests.runtime.rpc.test_ps_training import Cluster, gather_table, local_reference, run_ok, trained

pytestmark = pytest.mark.serial  # parameter-server jobs

TRAINERS = 2


def programs(model: str, endpoints: list[str], trainers: int = TRAINERS, opt: str = "sgd") -> Any:
    """The transpiler the cluster's processes used (same model, endpoints and trainers)."""
    args = argparse.Namespace(model=model, opt=opt, lr="const", geo=0, async_mode=False)
    role = SimpleNamespace(trainer_id=0, pservers=",".join(endpoints), trainers=trainers)
    return ps_worker.transpiler(args, role)


def saved_job(tmp_path: pathlib.Path, clusters: list[Cluster], monkeypatch: pytest.MonkeyPatch, model: str,
              pservers: int, opt: str = "sgd") -> tuple[Cluster, pathlib.Path]:
    """A sync job of ``pservers`` x 2 trainers that trains 3 steps and saves at the end into an absolute
    directory, with no FLOTILLA_CHECKPOINT_ROOT anywhere."""
    monkeypatch.delenv("FLOTILLA_CHECKPOINT_ROOT", raising=False)
    ckpt = tmp_path / "anywhere" / "ck"
    out = tmp_path / "job"
    out.mkdir()
    c = run_ok(clusters, out, pservers, TRAINERS,
               ["--model", model, "--opt", opt, "--steps", "3", "--save-at", "3", "--ckpt", str(ckpt)])
    return c, ckpt


def predictions(main: Any, scope: Any) -> np.ndarray:
    """The model's outputs on trainer 0's batches, by the inference clone of ``main``."""
    import runtime

    infer = main.clone(for_test=True)
    (pred,) = [op.output("Out")[0] for op in infer.global_block().ops if op.type == "elementwise_add"][-1:]
    exe = runtime.Executor()
    return np.concatenate([np.asarray(exe.run(infer, feed=ps_worker.batch("table", 0, step), fetch_list=[pred],
                                              scope=scope)[0]) for step in range(3)])


@pytest.fixture(scope="module")
def table_job(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A 2-pserver x 2-trainer sync job of the table model with Adam, checkpointed after its last step."""
    tmp = tmp_path_factory.mktemp("table_job")
    made: list[Cluster] = []
    with pytest.MonkeyPatch.context() as mp:
        yield saved_job(tmp, made, mp, "table", 2, opt="adam")
    for c in made:
        c.kill()


def single_machine(ckpt: pathlib.Path) -> tuple[Any, Any, Any]:
    import runtime

    main, startup = ps_worker.build("table", "adam", "const")
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    io.load_persistables(exe, str(ckpt), main, scope=scope)
    return main, startup, scope


def test_a_trainer_saves_into_any_absolute_directory(table_job: Any) -> None:
    import runtime

    c, ckpt = table_job  # saved with no FLOTILLA_CHECKPOINT_ROOT anywhere
    assert sorted(os.listdir(ckpt)) == ["pserver_0", "pserver_1"]
    t, _ = programs("table", c.endpoints, opt="adam")
    for i, ep in enumerate(c.endpoints):
        prog, startup = t.get_pserver_programs(ep)
        exe, scope = runtime.Executor(), runtime.Scope()
        exe.run(startup, scope=scope)
        io.load_persistables(exe, str(ckpt), prog, scope=scope)
        final = np.load(c.out / f"pserver_{i}.npz")
        assert final.files
        for name in final.files:
            np.testing.assert_array_equal(scope.numpy(name), final[name], err_msg=f"{ep} {name}")


def test_a_distributed_checkpoint_loads_into_the_single_machine_program(table_job: Any) -> None:
    import runtime

    c, ckpt = table_job
    main, startup, scope = single_machine(ckpt)
    exe = runtime.Executor()
    # what the trainer held after its last step, and the table the pservers ended with
    held = {**dict(np.load(c.out / "trainer_0.npz")), "table": gather_table(c.out, 2, "")}
    for name, value in held.items():
        np.testing.assert_array_equal(scope.numpy(name), value, err_msg=name)
    # every persistable came from the checkpoint, Adam's sliced and sharded moments included
    assert scope.numpy("fc_w_moment1_0").shape == (ps_worker.DIM + ps_worker.EMB, ps_worker.HIDDEN)
    assert scope.numpy("table_moment1_0").shape == (ps_worker.TABLE_ROWS, ps_worker.EMB)
    assert np.any(scope.numpy("table_moment1_0") != 0)
    reference = runtime.Scope()
    exe.run(startup, scope=reference)
    with x64():
        for name, value in held.items():
            reference.set_var(name, value)
    np.testing.assert_allclose(predictions(main, scope), predictions(main, reference), rtol=1e-12)


@pytest.mark.parametrize("pservers", [1, 3])
def test_a_checkpoint_reslices_into_another_number_of_pservers(table_job: Any, pservers: int) -> None:
    import runtime

    c, ckpt = table_job
    _, _, whole = single_machine(ckpt)
    endpoints = [f"127.0.0.1:{7100 + i}" for i in range(pservers)]  # never served: programs only
    t, _ = programs("table", endpoints, opt="adam")
    exe = runtime.Executor()
    seen = set()
    for ep in endpoints:
        prog, startup = t.get_pserver_programs(ep)
        scope = runtime.Scope()
        exe.run(startup, scope=scope)
        io.load_persistables(exe, str(ckpt), prog, scope=scope)
        layouts = io.slice_layouts(prog, io.pserver_checkpoint_vars(prog))
        for var in io.pserver_checkpoint_vars(prog):
            got, layout = scope.numpy(var.name), layouts.get(var.name, {})
            of = whole.numpy(layout.get("of", var.name))
            if layout.get("how") == "rows":
                want = of[layout["offset"]:layout["offset"] + var.shape[0]]
            elif layout.get("how") == "mod":
                rows = np.arange(var.shape[0]) * pservers + layout["index"]
                got, want = got[rows < len(of)], of[rows[rows < len(of)]]  # past the table: padding, never read
            else:
                want = of
            np.testing.assert_array_equal(got, want, err_msg=f"{ep} {var.name}")
            seen.add(layout.get("how"))
    assert seen >= ({None, "mod", "copy", "rows"} if pservers > 1 else {None, "mod"})


def test_training_continues_on_three_pservers_from_a_two_pserver_checkpoint(
        table_job: Any, tmp_path: pathlib.Path, clusters: list[Cluster]) -> None:
    """The 2-pserver job's 3 steps, then 3 more on 3 pservers from its checkpoint, are single-process training
    of all 6 steps from the job's initial values (test_ps_training's criterion for a whole sync job)."""
    c, ckpt = table_job
    args = ["--model", "table", "--opt", "adam"]
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    run_ok(clusters, resumed, 3, TRAINERS, args + ["--first-step", "3", "--steps", "3", "--load", str(ckpt)])
    expected = local_reference("table", "adam", "const", trained(c.out, "table", 2, "_init"), TRAINERS, range(6))
    got = {**dict(np.load(resumed / "trainer_0.npz")), "table": gather_table(resumed, 3, "")}
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-9, atol=1e-12, err_msg=name)
