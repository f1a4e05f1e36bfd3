"""``flotilla checkpoint inspect DIR`` on real checkpoints: what each holds, and its manifests verified."""
from __future__ import annotations

import argparse
import pathlib
import shutil
from types import SimpleNamespace

import pytest

from runtime import io
from tests.flotilla.test_cli import assert_user_error, flotilla  # noqa: F401 (a fixture)
from tests.runtime.rpc import ps_worker

ENDPOINTS = ["127.0.0.1:6170", "127.0.0.1:6171"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A 2-pserver checkpoint of the fc model with Adam (fc_w sliced over both), written by each pserver
    program's save_persistables; no network involved."""
    import runtime

    args = argparse.Namespace(model="fc", opt="adam", lr="const", geo=0, async_mode=False)
    t, _ = ps_worker.transpiler(args, SimpleNamespace(trainer_id=0, pservers=",".join(ENDPOINTS), trainers=2))
    ckpt = tmp_path_factory.mktemp("ckpt") / "ck"
    exe = runtime.Executor()
    for ep in ENDPOINTS:
        prog, startup = t.get_pserver_programs(ep)
        scope = runtime.Scope()
        exe.run(startup, scope=scope)
        io.save_persistables(exe, str(ckpt), prog, scope=scope)
    return ckpt


def test_inspect_lists_every_variable_and_its_slice(flotilla, checkpoint: pathlib.Path) -> None:
    done = flotilla("checkpoint", "inspect", checkpoint)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1].startswith("ok: ") and "2 part(s), manifests verified" in lines[-1]
    # fc_w (12 x 40) is sliced in two row blocks, one per pserver
    assert "/fc_w.block0: fc_w.block0 lod_tensor float64 [6, 40] (rows 0.. of fc_w)" in done.stdout
    assert "/fc_w.block1: fc_w.block1 lod_tensor float64 [6, 40] (rows 6.. of fc_w)" in done.stdout
    assert {line.partition("/")[0] for line in lines if "fc_w.block" in line} == {"pserver_0", "pserver_1"}
    assert "(copy of " in done.stdout  # a sliced parameter's Adam beta powers, one per slice
    # one part on its own
    part = flotilla("checkpoint", "inspect", checkpoint / "pserver_1")
    assert part.returncode == 0 and "1 part(s)" in part.stdout


def test_inspect_names_a_tampered_or_missing_file(flotilla, checkpoint: pathlib.Path, tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    (victim,) = bad.glob(f"pserver_*/{io.var_filename('fc_w.block1')}")
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    assert_user_error(flotilla("checkpoint", "inspect", bad), "was tampered with or damaged: fc_w.block1")
    victim.unlink()
    assert_user_error(flotilla("checkpoint", "inspect", bad), "is torn: fc_w.block1 is missing")
    assert_user_error(flotilla("checkpoint", "inspect", tmp_path / "nowhere"), "is not a directory")
