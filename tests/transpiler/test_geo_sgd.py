"""Geo-SGD (``geo_sgd_mode``): the golden programs, the config's errors and determinism.

The trainer keeps every optimizer (the distributed table's too) and ends with one ``geo_sync``; each
pserver adds the received deltas to its blocks and table shard (``sum``).
"""
from __future__ import annotations

from typing import Any

import pytest

from ir.errors import FlotillaError
from ir.printer import format_program
from ir.serialize import program_to_bytes
from tests.passes.ctr_model import build_ctr
from tests.flotilla.conftest import flotilla_exe  # noqa: F401 (a fixture)
from tests.flotilla.test_cli_transpile import (assert_user_error, fc_files, flotilla,  # noqa: F401
                                                 fresh_names, inputs, reference)
from tests.transpiler.test_distribute_transpiler import EPS2, build_fc, transpile
from transpiler import DistributeTranspiler, DistributeTranspilerConfig


def geo(k: int = 4, **extra: Any) -> DistributeTranspilerConfig:
    return DistributeTranspilerConfig(geo_sgd_mode=True, geo_sgd_need_push_nums=k, **extra)


def geo_fc(opt: str = "momentum", k: int = 4) -> DistributeTranspiler:
    return transpile(*build_fc(opt=opt), sync_mode=False, config=geo(k))


def geo_ctr(opt: str = "adam", k: int = 2) -> DistributeTranspiler:
    t = DistributeTranspiler(geo(k))
    main, startup = build_ctr(opt)
    t.transpile(1, program=main, pservers=EPS2, trainers=2, sync_mode=False, startup_program=startup)
    return t


@pytest.mark.parametrize("name,make", [("geo_momentum_2ps_2tr_k4", geo_fc), ("geo_dist_table_adam_2ps_2tr_k2", geo_ctr)])
def test_golden(name: str, make: Any, golden: Any) -> None:
    golden.check(f"{name}.txt", make().program_set.to_string())


def test_trainer_keeps_dense_optimizer_and_syncs_last() -> None:
    t = geo_fc(k=3)
    ops = t.get_trainer_program().global_block().ops
    assert [op.type for op in ops if op.type in ("momentum", "send", "recv", "geo_sync")] == \
        ["momentum", "momentum", "geo_sync"]
    sync = ops[-1]
    assert sync.type == "geo_sync" and sync.attr("push_nums") == 3
    assert sync.attr("delta_names") == [f"{b}@DELTA" for b in sync.attr("block_names")]
    startup = t.get_trainer_startup_program().global_block().ops
    assert [op.type for op in startup[-3:]] == ["fill_constant", "assign", "assign"]


def test_table_trains_on_the_trainer_and_syncs_its_touched_rows() -> None:
    t = geo_ctr()
    trainer = t.get_trainer_program().global_block()
    assert sorted(n for op in trainer.ops if op.type == "adam" for n in op.input("Param")) == ["fc_b", "fc_w", "table"]
    assert [op.type for op in trainer.ops if op.type in ("send", "recv", "prefetch", "split_ids")] == []
    assert [op.type for op in trainer.ops if op.type == "lookup_table"] == ["lookup_table"]
    sync = trainer.ops[-1]
    assert sync.type == "geo_sync" and sorted(sync.input("X")) == ["fc_b", "fc_w"]
    assert (sync.input("Table"), sync.input("TableIds"), sync.input("Touched")) == \
        (["table"], ["ids"], ["table@GEO_TOUCHED"])
    assert sync.attr("table_epmap") == EPS2.split(",")
    assert (sync.attr("table_delta_name"), sync.attr("table_updates_name")) == ("table@DELTA", "table@GEO_UPDATES")
    startup = t.get_trainer_startup_program().global_block()
    assert [op.type for op in startup.ops if "table" in op.output_arg_names] == ["geo_table_init"]
    assert startup.ops[-1].type == "geo_table_init" and startup.ops[-1].attr("rows") == 1001
    for ep in EPS2.split(","):
        ps = t.get_pserver_program(ep)
        serve = ps.global_block().ops[-1]
        assert serve.attr("lr_decay_block_id") == -1 and serve.attr("prefetch_var_name_to_block_id") == []
        assert "table@DELTA:table" in serve.attr("sparse_grad_to_param")
        table_block = ps.block(ps.num_blocks - 2)
        assert [(op.type, op.input("X")) for op in table_block.ops] == [("sum", ["table", "table@DELTA"])]
        assert not [op for b in ps.blocks for op in b.ops if op.type in ("adam", "scale", "lookup_sparse_table")]


@pytest.mark.parametrize("kwargs,match", [
    ({"geo_sgd_need_push_nums": 0}, "geo_sgd_need_push_nums must be an int >= 1"),
    ({"geo_sgd_need_push_nums": True}, "geo_sgd_need_push_nums must be an int >= 1"),
    ({"geo_sgd_mode": True, "enable_dc_asgd": True}, "geo_sgd_mode and enable_dc_asgd"),
    ({"geo_sgd_mode": True, "mode": "collective"}, "geo_sgd_mode needs mode 'pserver'"),
])
def test_config_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(FlotillaError, match=match) as info:
        DistributeTranspiler(DistributeTranspilerConfig(**kwargs))
    assert info.value.code == "E717" and info.value.hint


def test_sync_mode_refused() -> None:
    with pytest.raises(FlotillaError, match="geo_sgd_mode needs asynchronous training") as info:
        transpile(*build_fc(), sync_mode=True, config=geo())
    assert info.value.code == "E717" and "sync_mode=False" in info.value.hint


@pytest.mark.parametrize("make", [geo_fc, geo_ctr])
def test_deterministic(make: Any) -> None:
    a, b = make().program_set, make().program_set
    assert a.to_string() == b.to_string()
    for (role, pa), (_, pb) in zip(a.items(), b.items()):
        for x, y in ((pa.main, pb.main), (pa.startup, pb.startup)):
            assert program_to_bytes(x) == program_to_bytes(y), role


def test_transpiling_twice_with_one_transpiler_is_stable() -> None:
    t = DistributeTranspiler(geo(2))
    main, startup = build_fc()
    t.transpile(0, program=main, pservers=EPS2, trainers=2, sync_mode=False, startup_program=startup)
    first = t.program_set.to_string()
    t.transpile(0, program=main, pservers=EPS2, trainers=2, sync_mode=False, startup_program=startup)
    assert t.program_set.to_string() == first


# --- the CLI -------------------------------------------------------------------------------------------

def test_cli_geo_sgd_matches_the_api(flotilla: Any, fc_files: Any, tmp_path: Any) -> None:
    out = tmp_path / "out"
    done = flotilla("transpile", *inputs(fc_files), "--trainer-id", "1", "--async", "--geo-sgd", "3", "-o", out)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    expected = reference(*fc_files, trainer_id=1, sync_mode=False, config=geo(3))
    assert (out / "trainer.1.main.txt").read_text() == format_program(expected.get_trainer_program())
    assert (out / "pserver@127.0.0.1_6174.main.txt").read_text() == \
        format_program(expected.get_pserver_program("127.0.0.1:6174"))


@pytest.mark.parametrize("extra,fragment", [([], "geo_sgd_mode needs asynchronous training"),
                                            (["--async", "--geo-sgd", "0"], "geo_sgd_need_push_nums must be")])
def test_cli_geo_sgd_errors(flotilla: Any, fc_files: Any, tmp_path: Any, extra: list[str], fragment: str) -> None:
    args = extra if extra else ["--geo-sgd", "2"]
    assert_user_error(flotilla("transpile", *inputs(fc_files), *args, "-o", tmp_path / "out"), fragment)
