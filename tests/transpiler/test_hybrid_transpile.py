"""Hybrid mode (``config.mode = "hybrid"``): the dense parameters are allreduced among the trainers (the nccl2
rewrite) while the distributed lookup table stays on the pservers (prefetch + sparse update), in one trainer
program. Goldens of the whole ProgramSet, the structure both pipelines guarantee, the argument errors, and
the verifier's hybrid checks (every dense gradient reduced, every table gradient sent to its pservers) on
corrupted copies of a valid set."""
from __future__ import annotations

from typing import Any

import pytest

from ir.core import Program
from ir.program_set import ProgramRole, ProgramSet
from ir.verify import Code, cross_program_problems, verify_program_set
from tests.passes.ctr_model import build_ctr
from tests.transpiler.test_distribute_transpiler import build_fc
from tests.transpiler.test_transpiler_inputs import expect_error
from transpiler import DistributeTranspiler, DistributeTranspilerConfig

PS1 = "127.0.0.1:6174"
PS2 = "127.0.0.1:6174,127.0.0.1:6175"
TRAINERS = "127.0.0.1:6170,127.0.0.1:6171"
DENSE = ("fc_w", "fc_b")


def hybrid(trainer_id: int = 0, opt: str = "sgd", pservers: str = PS1, trainers: Any = TRAINERS,
           sync_mode: bool = True, program: tuple[Program, Program] | None = None,
           **cfg: Any) -> DistributeTranspiler:
    main, startup = program if program is not None else build_ctr(opt)
    t = DistributeTranspiler(DistributeTranspilerConfig(mode="hybrid", **cfg))
    t.transpile(trainer_id, program=main, startup_program=startup, pservers=pservers, trainers=trainers,
                sync_mode=sync_mode)
    return t


CASES: dict[str, dict[str, Any]] = {
    "hybrid_sync_1ps_2tr": {},
    "hybrid_async_adam_2ps_2tr_rank1": {"trainer_id": 1, "opt": "adam", "pservers": PS2, "sync_mode": False},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case: str, golden: Any) -> None:
    golden.check(f"{case}.txt", hybrid(**CASES[case]).program_set.to_string())


def test_transpiling_twice_gives_the_same_programs_and_they_verify() -> None:
    main, startup = build_ctr("adam")
    t = hybrid(program=(main, startup), pservers=PS2)
    first = t.program_set.to_string()
    t2 = hybrid(program=(main, startup), pservers=PS2)
    assert t2.program_set.to_string() == first
    verify_program_set(t.program_set)


def _types(program: Program, block: int = 0) -> list[str]:
    return [op.type for op in program.block(block).ops]


@pytest.mark.parametrize("sync", [True, False])
def test_dense_allreduced_on_trainers_table_on_pservers(sync: bool) -> None:
    t = hybrid(opt="adam", pservers=PS2, sync_mode=sync)
    main = t.get_trainer_program()
    block = main.global_block()
    reduced = [n for op in block.ops if op.type == "c_allreduce_sum" for n in op.input("X")]
    assert sorted(reduced) == sorted(f"{p}@GRAD" for p in DENSE)
    updated = [op.input("Param")[0] for op in block.ops if op.type == "adam"]
    assert sorted(updated) == sorted(DENSE), "the dense optimizers stay on the trainer, the table's leaves"
    sends = [op for op in block.ops if op.type == "send"]
    assert [op.role_var for op in sends] == [["table", "table@GRAD"]]
    assert sends[0].attr("epmap") == PS2.split(",")
    assert "recv" not in _types(main) and "prefetch" in _types(main)
    assert ("send_barrier" in _types(main)) is sync and ("fetch_barrier" in _types(main)) is sync
    startup = _types(t.get_trainer_startup_program())
    assert startup[0] == "gen_nccl_id" and "recv" not in startup and "fetch_barrier" not in startup
    broadcast = [op.input("X")[0] for op in t.get_trainer_startup_program().global_block().ops
                 if op.type == "c_broadcast"]
    assert sorted(broadcast) == sorted(DENSE)
    for ep in PS2.split(","):
        ps = t.get_pserver_program(ep)
        held = [v.name for v in ps.global_block().vars.values() if v.is_parameter]
        assert held == ["table"], f"{ep} holds {held}"
        assert [op.input("Param")[0] for b in ps.blocks for op in b.ops if op.type == "adam"] == ["table"]
        serv = ps.global_block().ops[-1]
        assert serv.attr("Fanin") == 2 and serv.attr("sync_mode") is sync


def test_exact_arguments_and_refusals() -> None:
    expect_error(lambda: hybrid(trainers=2), "E702", "needs every trainer's endpoint")
    expect_error(lambda: hybrid(program=build_fc()), "E605", "distributed lookup table")
    expect_error(lambda: hybrid(enable_dc_asgd=True), "E722", "enable_dc_asgd")
    expect_error(lambda: hybrid(trainers=f"{PS1},127.0.0.1:6171"), "E722", "both a pserver and a trainer")
    expect_error(lambda: hybrid(collective_mode="local_sgd"), "E711", "local_sgd")
    expect_error(lambda: hybrid(geo_sgd_mode=True, sync_mode=False), "E717", "geo_sgd_mode")
    t = hybrid(trainer_id=1)
    assert t.get_trainer_startup_program().global_block().ops[0].attr("endpoint") == "127.0.0.1:6171"
    expect_error(lambda: hybrid(trainer_id=2), "E703", "out of range")


# --- the verifier's hybrid checks -----------------------------------------------------------------------


def _set(**kw: Any) -> ProgramSet:
    return hybrid(**kw).program_set


def _trainer_block(ps: ProgramSet) -> Any:
    return ps[ProgramRole.trainer(0)].main.global_block()


def _index(block: Any, op_type: str, grad: str | None = None) -> int:
    for i, op in enumerate(block.ops):
        if op.type == op_type and (grad is None or grad in op.input_arg_names):
            return i
    raise LookupError(f"no {op_type} of {grad}")


def _only(ps: ProgramSet, code: str) -> list[str]:
    problems = cross_program_problems(ps)
    assert [p.code for p in problems] == [code] * len(problems) and problems, [str(p) for p in problems]
    return [str(p) for p in problems]


def test_clean_hybrid_sets_have_no_problem() -> None:
    for kw in ({}, {"opt": "adam", "pservers": PS2, "sync_mode": False}, {"trainer_id": 1}):
        assert cross_program_problems(_set(**kw)) == []


def test_a_dense_gradient_never_allreduced_is_named() -> None:
    ps = _set(fuse_grad_size_in_MB=0)  # one c_allreduce_sum a gradient
    block = _trainer_block(ps)
    block.remove_op(_index(block, "c_allreduce_sum", "fc_w@GRAD"))
    [message] = _only(ps, Code.DENSE_GRAD_NOT_REDUCED)
    assert "'fc_w@GRAD' of 'fc_w' is never allreduced" in message and "trainer.0/block 0/op" in message


def test_a_dense_gradient_summed_but_not_averaged_is_named() -> None:
    ps = _set()
    block = _trainer_block(ps)
    at = next(i for i, op in enumerate(block.ops) if op.type == "scale" and op.input("X") == ["fc_b@GRAD"])
    block.remove_op(at)
    [message] = _only(ps, Code.DENSE_GRAD_NOT_REDUCED)
    assert "'fc_b@GRAD'" in message and "never scaled by 1/2" in message


def test_a_gradient_written_after_its_allreduce_is_named() -> None:
    ps = _set(fuse_grad_size_in_MB=0)
    block = _trainer_block(ps)
    op = block.ops[_index(block, "c_allreduce_sum", "fc_b@GRAD")]
    block.remove_op(_index(block, "c_allreduce_sum", "fc_b@GRAD"))
    # Reduce before the backward op that writes the gradient: the sum would miss it.
    writer = next(i for i, o in enumerate(block.ops) if "fc_b@GRAD" in o.output_arg_names)
    block.insert_op(writer, op.type, dict(op.inputs), dict(op.outputs), dict(op.attrs))
    [message] = _only(ps, Code.DENSE_GRAD_NOT_REDUCED)
    assert "'fc_b@GRAD'" in message and "after its c_allreduce_sum" in message


def test_a_table_gradient_that_reaches_no_pserver_is_named() -> None:
    ps = _set(pservers=PS2)
    block = _trainer_block(ps)
    send = block.ops[_index(block, "send")]
    send.set_attr("epmap", [PS2.split(",")[0]] * len(send.input("X")))
    messages = [str(p) for p in cross_program_problems(ps) if p.code == Code.TABLE_GRAD_NOT_SENT]
    assert len(messages) == 1 and "'table' prefetched from ['127.0.0.1:6175']" in messages[0]
    block.remove_op(_index(block, "send"))
    messages = [str(p) for p in cross_program_problems(ps) if p.code == Code.TABLE_GRAD_NOT_SENT]
    assert len(messages) == 1 and "['127.0.0.1:6174', '127.0.0.1:6175']" in messages[0]
