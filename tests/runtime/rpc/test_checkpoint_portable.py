"""Checkpoints of real pserver jobs (issue 21): saved anywhere the job names, loaded anywhere.

A trainer names its checkpoint by an absolute path without any checkpoint root, as in Fluid; the files
land there and load back into the pservers.
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
from tests.runtime.rpc import ps_worker
from tests.runtime.rpc.test_ps_training import Cluster, clusters, run_ok  # noqa: F401 (fixture)

TRAINERS = 2


def programs(model: str, endpoints: list[str], trainers: int = TRAINERS) -> Any:
    """The transpiler the cluster's processes used (same model, endpoints and trainers)."""
    args = argparse.Namespace(model=model, opt="sgd", lr="const", geo=0, async_mode=False)
    role = SimpleNamespace(trainer_id=0, pservers=",".join(endpoints), trainers=trainers)
    return ps_worker.transpiler(args, role)


def saved_job(tmp_path: pathlib.Path, clusters: list[Cluster], monkeypatch: pytest.MonkeyPatch, model: str,
              pservers: int) -> tuple[Cluster, pathlib.Path]:
    """A sync job of ``pservers`` x 2 trainers that trains 3 steps and saves at the end into an absolute
    directory, with no FLOTILLA_CHECKPOINT_ROOT anywhere."""
    monkeypatch.delenv("FLOTILLA_CHECKPOINT_ROOT", raising=False)
    ckpt = tmp_path / "anywhere" / "ck"
    out = tmp_path / "job"
    out.mkdir()
    c = run_ok(clusters, out, pservers, TRAINERS,
               ["--model", model, "--steps", "3", "--save-at", "3", "--ckpt", str(ckpt)])
    return c, ckpt


def test_a_trainer_saves_into_any_absolute_directory(tmp_path: pathlib.Path, clusters: list[Cluster],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime

    c, ckpt = saved_job(tmp_path, clusters, monkeypatch, "fc", 1)
    assert sorted(os.listdir(ckpt)) == ["pserver_0"]
    t, _ = programs("fc", c.endpoints)
    prog, startup = t.get_pserver_programs(c.endpoints[0])
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    io.load_persistables(exe, str(ckpt), prog, scope=scope)
    final = np.load(c.out / "pserver_0.npz")
    assert set(final.files) and all(np.array_equal(scope.numpy(n), final[n]) for n in final.files)
