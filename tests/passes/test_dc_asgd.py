"""DC-ASGD (``enable_dc_asgd=True``, async): per-trainer backups and the compensated gradient."""
from __future__ import annotations

import pathlib

import pytest

from ir.errors import FlotillaError
from ir.names import dc_asgd_backup_name
from ir.verify import verify, verify_program_set
from tests.conftest import Golden
from tests.transpiler.test_distribute_transpiler import build_fc, transpile
from transpiler import DistributeTranspilerConfig

GOLDENS = pathlib.Path(__file__).parent.parent / "transpiler" / "goldens"


def dc_transpile():  # type: ignore[no-untyped-def]
    return transpile(*build_fc(), sync_mode=False, config=DistributeTranspilerConfig(enable_dc_asgd=True))


def test_dc_asgd_pserver_blocks() -> None:
    t = dc_transpile()
    for role, progs in t.program_set.items():
        verify(progs.main, role=role)
        verify(progs.startup, role=role)
    verify_program_set(t.program_set)
    ps, st = t.get_pserver_programs("127.0.0.1:6174")
    assert [op.type for op in ps.block(2).ops] == [
        "ref_by_trainer_id", "elementwise_sub", "elementwise_mul", "elementwise_mul", "elementwise_add", "sgd"]
    blk = ps.block(2)
    assert blk.ops[0].input("X") == ["fc_w.block1.trainer_0_bak", "fc_w.block1.trainer_1_bak"]
    assert blk.ops[1].input("X") == ["fc_w.block1"] and blk.ops[1].input("Y") == ["fc_w.block1.local_bak"]
    assert blk.ops[5].input("Grad") == blk.ops[4].output("Out")
    assert blk.ops[4].input("X") == ["fc_w@GRAD.block1"]
    # The runtime finds the backups through ir.names.dc_asgd_backup_name: the names must agree.
    assert dc_asgd_backup_name("fc_w.block1", 1) == "fc_w.block1.trainer_1_bak"
    assert blk.ops[0].input("X") == [dc_asgd_backup_name("fc_w.block1", t) for t in range(2)]
    bak = ps.global_block().var(dc_asgd_backup_name("fc_w.block1", 1))
    assert bak.shape == (500, 1000) and bak.copy_of == "fc_w.block1" and bak.trainer_id == 1
    assert ps.global_block().ops[0].attr("dc_asgd") is True
    assigns = [(op.input("X"), op.output("Out")) for op in st.global_block().ops if op.type == "assign"]
    assert assigns == [(["fc_b"], ["fc_b.trainer_0_bak"]), (["fc_b"], ["fc_b.trainer_1_bak"]),
                       (["fc_w.block1"], ["fc_w.block1.trainer_0_bak"]),
                       (["fc_w.block1"], ["fc_w.block1.trainer_1_bak"])]


def test_dc_asgd_needs_async() -> None:
    with pytest.raises(FlotillaError, match="E709"):
        transpile(*build_fc(), sync_mode=True, config=DistributeTranspilerConfig(enable_dc_asgd=True))


def test_dc_asgd_golden(request: pytest.FixtureRequest) -> None:
    golden = Golden(GOLDENS, request.config.getoption("--update-goldens"))
    golden.check("dc_asgd_async_2ps_2tr.txt", dc_transpile().program_set.to_string())
