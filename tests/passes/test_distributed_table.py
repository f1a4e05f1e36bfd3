"""The distributed lookup table rewrite (pass ``distributed_table``) on a CTR-like model, and a
property test over random distributed-table programs (table size, width, optimizer, pservers,
trainers, sync/async): the ProgramSet verifies, every shard has ``ceil(rows / n)`` rows, every
``listen_and_serv`` carries ``pservers == n``, and transpiling again gives identical bytes."""
from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flotilla.fluid import layers, optimizer
from ir.core import Program, program_guard
from ir.errors import FlotillaError
from ir.names import unique_name
from flotilla.fluid.param_attr import ParamAttr
from ir.serialize import program_to_bytes
from ir.verify import cross_program_problems, verify, verify_program_set
from tests.conftest import Golden
from tests.passes.ctr_model import transpile_ctr
from transpiler import DistributeTranspiler

GOLDENS = pathlib.Path(__file__).parent.parent / "transpiler" / "goldens"
EP0, EP1 = "127.0.0.1:6174", "127.0.0.1:6175"


def ops(program: Program, block: int = 0) -> list[str]:
    return [op.type for op in program.block(block).ops]


def check_all_verify(t: Any) -> None:
    for role, progs in t.program_set.items():
        verify(progs.main, role=role)
        verify(progs.startup, role=f"{role}/startup")
    verify_program_set(t.program_set)


@pytest.mark.parametrize("pservers,sync", [(1, True), (2, True), (1, False), (2, False)])
def test_trainer_program(pservers: int, sync: bool) -> None:
    t = transpile_ctr(pservers=pservers, sync_mode=sync)
    check_all_verify(t)
    main = t.get_trainer_program(wait_port=False)
    expected = ["split_ids", "prefetch", "merge_ids", "reshape", "concat", "mul", "elementwise_add",
                "elementwise_sub", "square", "mean", "fill_constant", "mean_grad", "square_grad",
                "elementwise_sub_grad", "elementwise_add_grad", "mul_grad", "concat_grad",
                "reshape_grad", "lookup_table_grad", "split_ids", "send", "send", "send"]
    if sync:
        expected += ["send_barrier", "recv", "recv", "fetch_barrier"]
    else:
        expected += ["recv", "recv"]
    assert ops(main) == expected
    block = main.global_block()
    prefetch = block.ops[1]
    assert prefetch.attr("epmap") == [f"127.0.0.1:{6174 + i}" for i in range(pservers)]
    assert prefetch.attr("height_sections") == [-(-1001 // pservers)] * pservers
    assert block.ops[2].output("Out") == ["embedding_0.tmp_0"]
    send = block.ops[20]
    names = [f"table@GRAD.trainer_0.pserver_{i}" if sync else f"table@GRAD.pserver_{i}" for i in range(pservers)]
    assert send.input("X") == names
    assert send.role_var == ["table", "table@GRAD"]
    if sync:
        assert block.var(names[0]).copy_of == "table@GRAD.pserver_0"
        assert block.var(names[0]).trainer_id == 0
        assert "__control_var@send@table@GRAD" in block.ops[23].input("X")
    assert "lookup_table" not in ops(main)
    startup = t.get_trainer_startup_program()
    assert not any("table" in op.output_arg_names for op in startup.global_block().ops)
    assert not startup.global_block().has_var("table")


def test_pserver_programs_sync_two_trainers() -> None:
    t = transpile_ctr("adam", pservers=2, trainers=2)
    check_all_verify(t)
    for i, ep in enumerate((EP0, EP1)):
        ps, st = t.get_pserver_programs(ep)
        assert [ops(ps, b) for b in range(ps.num_blocks)] == [
            ["listen_and_serv"], ["sum", "scale", "adam", "scale", "scale"],
            ["sum", "scale", "adam", "scale", "scale"], ["lookup_sparse_table"], ["save"]]
        g = ps.global_block()
        shard = g.var("table")
        assert shard.shape == (501, 8)
        assert (shard.slice_of, shard.slice_index, shard.slice_offset) == ("table", i, i)
        assert g.var("table_moment1_0").shape == (501, 8)
        assert ps.block(2).ops[0].input("X") == [f"table@GRAD.trainer_{k}.pserver_{i}" for k in range(2)]
        assert ps.block(2).ops[1].attr("scale") == 0.5
        assert ps.block(2).ops[2].input("Grad") == [f"table@GRAD.pserver_{i}"]
        serv = g.ops[0]
        assert serv.attr("grad_to_block_id")[-1] == f"table@GRAD.pserver_{i}:2"
        assert serv.attr("sparse_grad_to_param") == [f"table@GRAD.pserver_{i}:table"]
        assert serv.attr("prefetch_var_name_to_block_id") == [f"prefetch_compress_in_tmp_{i}:3"]
        assert serv.attr("checkpoint_block_id") == 4
        assert [b.idx for b in serv.attr("optimize_blocks")] == [1, 2]
        assert ps.block(3).parent_idx == 2 and ps.block(4).parent_idx == 2
        init = [op for op in st.global_block().ops if op.output_arg_names == ["table"]]
        assert len(init) == 1 and init[0].type == "uniform_random" and init[0].attr("shape") == [501, 8]
        moments = [op for op in st.global_block().ops if op.output_arg_names == ["table_moment1_0"]]
        assert moments[0].attr("shape") == [501, 8]


def test_pserver_program_async_one_pserver() -> None:
    t = transpile_ctr("adagrad", pservers=1, sync_mode=False)
    check_all_verify(t)
    ps = t.get_pserver_program(EP0)
    assert [ops(ps, b) for b in range(ps.num_blocks)] == [
        ["listen_and_serv"], ["adagrad"], ["adagrad"], ["adagrad"], ["lookup_sparse_table"], ["save"]]
    assert ps.global_block().var("table").shape == (1001, 8)
    assert ps.block(3).ops[0].input("Grad") == ["table@GRAD.pserver_0"]
    assert "table@GRAD.pserver_0" in ps.global_block().ops[0].input("X")


def test_unsupported_table_optimizer() -> None:
    with pytest.raises(FlotillaError, match="E604"):
        transpile_ctr("momentum")


def test_deterministic() -> None:
    assert transpile_ctr().program_set.to_string() == transpile_ctr().program_set.to_string()


@pytest.mark.parametrize("name,kw", [("dist_table_sync_2ps_2tr", {}),
                                     ("dist_table_async_2ps_2tr", {"sync_mode": False}),
                                     ("dist_table_adam_sync_1ps_2tr", {"opt": "adam", "pservers": 1})])
def test_golden(name: str, kw: dict[str, Any], request: pytest.FixtureRequest) -> None:
    golden = Golden(GOLDENS, request.config.getoption("--update-goldens"))
    golden.check(f"{name}.txt", transpile_ctr(**kw).program_set.to_string())


# --- property: random distributed-table programs ---------------------------------------------------------

TABLE_OPTIMIZERS: dict[str, Callable[[], optimizer.Optimizer]] = {
    "sgd": lambda: optimizer.SGD(0.1), "adagrad": lambda: optimizer.Adagrad(0.1), "adam": lambda: optimizer.Adam(0.1),
}


@dataclass(frozen=True)
class TableCase:
    """A model with one distributed table [rows, width] and a dense fc, and the cluster it runs on."""

    rows: int
    width: int
    slots: int
    opt: str
    pservers: int
    trainers: int
    trainer_id: int
    sync: bool

    def build(self) -> tuple[Program, Program]:
        main, startup = Program(), Program()
        with unique_name.guard(), program_guard(main, startup):
            ids = layers.data(name="ids", shape=[self.slots], dtype="int64")
            emb = layers.embedding(ids, size=[self.rows, self.width], is_sparse=True, is_distributed=True,
                                   param_attr=ParamAttr(name="table"))
            pred = layers.fc(layers.reshape(emb, [-1, self.slots * self.width]), 1)
            loss = layers.mean(layers.square_error_cost(input=pred, label=layers.data(name="y", shape=[1])))
            TABLE_OPTIMIZERS[self.opt]().minimize(loss)
        return main, startup

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{7000 + i}" for i in range(self.pservers)]

    def transpile(self) -> DistributeTranspiler:
        t = DistributeTranspiler()
        main, startup = self.build()
        t.transpile(self.trainer_id, program=main, pservers=",".join(self.endpoints), trainers=self.trainers,
                    sync_mode=self.sync, startup_program=startup)
        return t


@st.composite
def table_cases(draw: st.DrawFn) -> TableCase:
    trainers = draw(st.integers(1, 8))
    return TableCase(rows=draw(st.integers(1, 5000)), width=draw(st.integers(1, 16)), slots=draw(st.integers(1, 4)),
                     opt=draw(st.sampled_from(sorted(TABLE_OPTIMIZERS))), pservers=draw(st.integers(1, 8)),
                     trainers=trainers, trainer_id=draw(st.integers(0, trainers - 1)), sync=draw(st.booleans()))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(table_cases())
def test_random_distributed_tables(case: TableCase) -> None:
    t = case.transpile()
    programs = t.program_set
    assert programs.roles == [f"trainer.{case.trainer_id}"] + [f"pserver@{ep}" for ep in case.endpoints]
    assert cross_program_problems(programs) == []
    verify_program_set(programs)
    n = case.pservers
    shard_rows = -(-case.rows // n)
    assert shard_rows * n >= case.rows > (shard_rows - 1) * n
    sharded = {"table"}
    for i, ep in enumerate(case.endpoints):
        ps, st_prog = t.get_pserver_programs(ep)
        g = ps.global_block()
        shard = g.var("table")
        assert shard.shape == (shard_rows, case.width)
        assert (shard.slice_of, shard.slice_index, shard.slice_offset) == ("table", i, i)
        serv = [op for op in g.ops if op.type == "listen_and_serv"]
        assert len(serv) == 1
        assert serv[0].attr("pservers") == n
        assert serv[0].attr("pserver_id") == i
        # The table's optimizer runs sparsely on the shard; its row-shaped accumulators are sharded too.
        table_opt = [op for b in ps.blocks for op in b.ops if op.type == case.opt and op.input("Param") == ["table"]]
        assert len(table_opt) == 1
        assert table_opt[0].input("Grad") == [f"table@GRAD.pserver_{i}"]
        for slot in {"adagrad": ["Moment"], "adam": ["Moment1", "Moment2"], "sgd": []}[case.opt]:
            acc = table_opt[0].input(slot)[0]
            sharded.add(acc)
            assert g.var(acc).shape == (shard_rows, case.width), (slot, acc)
        init = {name for op in st_prog.global_block().ops for name in op.output_arg_names}
        assert sharded <= init
        for op in st_prog.global_block().ops:
            if op.output_arg_names[:1] and op.output_arg_names[0] in sharded and op.has_attr("shape"):
                assert op.attr("shape") == [shard_rows, case.width]
    trainer = t.get_trainer_program(wait_port=False)
    prefetch = [op for op in trainer.global_block().ops if op.type == "prefetch"]
    assert len(prefetch) == 1 and prefetch[0].attr("height_sections") == [shard_rows] * n
    assert prefetch[0].attr("epmap") == case.endpoints
    # The table never lives on the trainer: only lookup_table_grad still names it (for its height).
    assert {op.type for op in trainer.global_block().ops if "table" in op.input_arg_names} <= {"lookup_table_grad"}
    again = case.transpile().program_set
    assert again.to_string() == programs.to_string()
    assert [(r, program_to_bytes(p.main), program_to_bytes(p.startup)) for r, p in again.items()] == [
        (r, program_to_bytes(p.main), program_to_bytes(p.startup)) for r, p in programs.items()]
