"""memory_optimize and release_memory as passes: liveness, exclusions, Paddle 1.5's unit tests, goldens,
and a property test over random runnable programs (run both, compare)."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ir.core import Program
from ir.ops.registry import BlockRef
from ir.printer import format_program
from ir.roles import OpRole
from ir.verify import collect_problems
from passes.liveness import block_cfg, block_liveness, fetch_targets, parameter_gradients, reuse_exclusions
from passes.memory_optimize import memory_optimize_program
from passes.memory_report import MemoryOptimizeError
from passes.release_memory import release_memory_program
from tests.passes.memory_models import control_flow_graph_model, memory_transpiler2_model, mlp, used_names


def _chain() -> Program:
    """a (data) → relu → t0 → scale → t1 → relu → t2 → sigmoid → t3 (t3: the result)."""
    p = Program()
    b = p.global_block()
    b.create_var("a", (-1, 4), is_data=True)
    for n in ("t0", "t1", "t2", "t3"):
        b.create_var(n, (-1, 4))
    b.append_op("relu", {"X": ["a"]}, {"Out": ["t0"]})
    b.append_op("scale", {"X": ["t0"]}, {"Out": ["t1"]}, {"scale": 2.0})
    b.append_op("relu", {"X": ["t1"]}, {"Out": ["t2"]})
    b.append_op("sigmoid", {"X": ["t2"]}, {"Out": ["t3"]})
    return p


# --- liveness ---------------------------------------------------------------------------------------------


def test_cfg_is_a_chain_of_the_ops() -> None:
    g = block_cfg(_chain().global_block())
    assert sorted(g.nodes) == [0, 1, 2, 3]
    assert sorted(g.edges) == [(0, 1), (1, 2), (2, 3)]


def test_liveness_fixed_point() -> None:
    lv = block_liveness(_chain().global_block())
    assert [sorted(s) for s in lv.live_in] == [["a"], ["t0"], ["t1"], ["t2"]]
    assert [sorted(s) for s in lv.live_out] == [["t0"], ["t1"], ["t2"], []]
    assert lv.dying_at(1) == ["t0"]
    assert lv.dying_at(3) == ["t2", "t3"]


def test_a_sub_block_op_keeps_what_its_blocks_read_live_and_excluded() -> None:
    p = _chain()
    b0 = p.global_block()
    sub = p.create_block(0)
    sub.create_var("local", (-1, 4))
    sub._append_raw_op("relu", {"X": ["t1"]}, {"Out": ["local"]}, {"op_role": 0, "op_role_var": []})
    p.rollback()
    b0._append_raw_op("listen_and_serv", {"X": []}, {}, {"optimize_blocks": [BlockRef(1)], "op_role": 0,
                                                         "op_role_var": []})
    lv = block_liveness(b0)
    assert "t1" in lv.live_in[4] and all("t1" in lv.live_out[i] for i in range(1, 4))
    assert reuse_exclusions(p)[0]["t1"] == "read across blocks (by block 1)"


def test_exclusions_read_recorded_relations() -> None:
    main, _, loss = mlp((4, 4))
    grads = parameter_gradients(main)
    assert grads == {"w0@GRAD", "b0@GRAD", "w1@GRAD", "b1@GRAD", "wo@GRAD", "bo@GRAD"}
    assert loss.name in fetch_targets(main)
    excluded = reuse_exclusions(main, {"fc_0.tmp_0"}, skip_grads=True)[0]
    assert excluded["fc_0.tmp_0"] == "in skip_opt_set"
    assert excluded["x"] == "fed (data)" and excluded["w0"] == "persistable"
    assert excluded[loss.name] == "fetch target"
    assert all(excluded[g] == "parameter gradient (skip_grads)" for g in grads)
    assert "fc_0.tmp_1" not in excluded


# --- Paddle 1.5's unit tests ------------------------------------------------------------------------------


def test_control_flow_graph() -> None:
    """TestControlFlowGraph: the optimized program uses other (fewer) variable names."""
    main, _ = control_flow_graph_model()
    before = used_names(main.clone())
    report = memory_optimize_program(main)
    after = used_names(main)
    assert after != before and len(after) < len(before)
    assert report.reused and collect_problems(main) == []


@pytest.mark.parametrize("with_skip", [False, True])
def test_memory_transpiler2(with_skip: bool) -> None:
    """TestMemoryTranspiler2, with and without skip_opt_set={cost, fc}."""
    main, cost, fc = memory_transpiler2_model()
    before = used_names(main.clone())
    skip = {cost.name, fc.name} if with_skip else None
    report = memory_optimize_program(main, skip)
    after = used_names(main)
    assert len(after) < len(before)
    assert collect_problems(main) == []
    if with_skip:
        assert {cost.name, fc.name} <= after
        assert {cost.name, fc.name} <= set(main.global_block().vars)
        assert all(r.var not in skip and r.onto not in skip for r in report.reused)


def test_never_touches_persistables_feeds_or_the_loss() -> None:
    main, _, loss = mlp((4, 4), opt="adam")
    keep = {n for n, v in main.global_block().vars.items() if v.persistable or v.is_data} | {loss.name}
    report = memory_optimize_program(main, level=1)
    assert report.reused
    assert all(r.var not in keep and r.onto not in keep for r in report.reused)
    assert keep <= set(main.global_block().vars)


def test_skip_grads_keeps_every_parameter_gradient() -> None:
    main, _, _ = mlp((4, 4))
    grads = parameter_gradients(main)
    report = memory_optimize_program(main, skip_grads=True)
    assert report.reused
    assert all(r.var not in grads and r.onto not in grads for r in report.reused)
    assert parameter_gradients(main) == grads


def test_without_skip_grads_op_role_var_follows_the_rename() -> None:
    """A reused gradient's new name is what op_role_var records: the relation is kept, not the name."""
    main, _, _ = mlp((4, 4))
    memory_optimize_program(main)
    for op in main.global_block().ops:
        for name in op.role_var:
            assert main.global_block().has_var(name), (op.type, name)


def test_level1_reuses_larger_buffers_and_still_verifies() -> None:
    l0, _, _ = mlp((4, 8))
    l1, _, _ = mlp((4, 8))
    r0 = memory_optimize_program(l0, level=0)
    r1 = memory_optimize_program(l1, level=1)
    assert len(r1.reused) > len(r0.reused)
    assert collect_problems(l1) == []
    assert r1.bytes_after < r0.bytes_after


def test_release_memory_deletes_after_last_uses() -> None:
    p = _chain()
    report = release_memory_program(p)
    assert [op.type for op in p.global_block().ops] == ["relu", "scale", "delete_var", "relu", "delete_var",
                                                       "sigmoid", "delete_var"]
    assert [d.names for d in report.deleted] == [("t0",), ("t1",), ("t2",)]
    assert report.bytes_after < report.bytes_before
    assert collect_problems(p) == []


def test_release_memory_gives_deletions_the_role_of_the_op_before() -> None:
    main, _, _ = mlp((4,))
    release_memory_program(main)
    ops = main.global_block().ops
    for i, op in enumerate(ops):
        if op.type == "delete_var":
            assert op.role == ops[i - 1].role and op.role_var == []
    assert any(op.type == "delete_var" and op.role == int(OpRole.OPTIMIZE) for op in ops)


def test_bad_arguments_modify_nothing() -> None:
    main, _, _ = mlp((4, 4))
    text = format_program(main)
    for kwargs, code in (({"level": 2}, "E660"), ({"level": True}, "E660"), ({"skip_opt_set": "x"}, "E661"),
                         ({"skip_opt_set": {1}}, "E661"), ({"batch_size": 0}, "E663")):
        with pytest.raises(MemoryOptimizeError) as e:
            memory_optimize_program(main, **kwargs)
        assert e.value.code == code
    with pytest.raises(MemoryOptimizeError) as e:
        release_memory_program(main, skip_opt_set=3)
    assert e.value.code == "E661"
    with pytest.raises(MemoryOptimizeError) as e:
        memory_optimize_program("main")  # type: ignore[arg-type]
    assert e.value.code == "E662"
    assert format_program(main) == text


# --- goldens ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["level0", "level1", "release", "level0_release"])
def test_golden_mlp(case: str, golden: Any) -> None:
    """An MLP (x[8] → fc 4 relu → fc 8 relu → fc 1 → mean square error, SGD) before and after."""
    main, _, _ = mlp((4, 8))
    before = format_program(main)
    golden.check("memory_mlp_before.txt", before)
    reports = []
    if case.startswith("level"):
        reports.append(memory_optimize_program(main, level=int(case[5]), batch_size=32))
    if case.endswith("release"):
        reports.append(release_memory_program(main, batch_size=32))
    assert collect_problems(main) == []
    text = "".join(f"// {line}\n" for r in reports for line in r.lines()) + format_program(main)
    golden.check(f"memory_mlp_{case}.txt", text)


# --- property: the rewrites never change what a program computes -------------------------------------------

_UNARY = ("relu", "sigmoid", "abs", "scale")
_BINARY = ("elementwise_add", "elementwise_sub", "elementwise_mul")
_WEIGHTS = {(4, 4): "w44", (4, 2): "w42", (2, 4): "w24"}


@st.composite
def runnable_programs(draw: Callable[[st.SearchStrategy[Any]], Any]) -> tuple[Program, list[str]]:
    """A random straight-line program over batch-by-4 and batch-by-2 float32 tensors: unary, binary and
    matrix ops, outputs fresh or overwriting an existing temporary (in place included); plus a random
    skip set. Returns (program, skip names)."""
    p = Program()
    b = p.global_block()
    b.create_var("x", (-1, 4), is_data=True, stop_gradient=True)
    for (i, o), name in _WEIGHTS.items():
        b.create_parameter(name, (i, o))
    by_width: dict[int, list[str]] = {4: ["x"], 2: []}
    temps: list[str] = []
    for k in range(draw(st.integers(2, 16))):
        kind = draw(st.sampled_from(("unary", "binary", "mul")))
        src_width = draw(st.sampled_from([w for w in (4, 2) if by_width[w]]))
        x = draw(st.sampled_from(by_width[src_width][-3:]))  # mostly recent values: older ones die
        attrs: dict[str, Any] = {}
        if kind == "mul":
            width = draw(st.sampled_from([o for (i, o) in _WEIGHTS if i == src_width]))
            op_type, inputs = "mul", {"X": [x], "Y": [_WEIGHTS[(src_width, width)]]}
        elif kind == "binary":
            width = src_width
            y = draw(st.sampled_from(by_width[width][-3:]))
            op_type, inputs = draw(st.sampled_from(_BINARY)), {"X": [x], "Y": [y]}
        else:
            width = src_width
            op_type, inputs = draw(st.sampled_from(_UNARY)), {"X": [x]}
            if op_type == "scale":
                attrs["scale"] = draw(st.sampled_from((0.5, -1.0, 2.0)))
        same = [t for t in temps if b.var(t).shape == (-1, width)]
        if same and draw(st.integers(0, 3)) == 0:
            out = draw(st.sampled_from(same))  # overwrite (possibly in place): Fluid is not SSA
        else:
            out = f"t{k}"
            b.create_var(out, (-1, width))
            temps.append(out)
            by_width[width].append(out)
        b.append_op(op_type, inputs, {"Out": [out]}, attrs)
    skip = [t for t in temps if draw(st.integers(0, 4)) == 0]
    return p, skip


def _run(program: Program, fetch: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import runtime

    scope, exe = runtime.Scope(), runtime.Executor()
    for name, value in feeds.items():
        if name != "x":
            scope.set_var(name, value)
    return exe.run(program, feed={"x": feeds["x"]}, fetch_list=fetch, scope=scope)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(runnable_programs(), st.sampled_from([0, 1]), st.booleans(), st.integers(0, 2**16))
def test_rewrites_never_change_what_a_program_computes(case: tuple[Program, list[str]], level: int,
                                                        release: bool, seed: int) -> None:
    program, skip = case
    assert collect_problems(program) == []
    reference = program.clone()
    outputs = sorted((fetch_targets(program) | set(skip)) - {"x"})
    memory_optimize_program(program, skip, level=level)
    if release:
        release_memory_program(program, skip)
    assert collect_problems(program) == []
    assert set(outputs) <= set(program.global_block().vars)
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.normal(size=(3, 4)).astype("float32")}
    feeds.update({n: rng.normal(size=shape).astype("float32") for shape, n in _WEIGHTS.items()})
    want = _run(reference, outputs, feeds)
    got = _run(program, outputs, feeds)
    for name, a, b in zip(outputs, want, got):
        np.testing.assert_array_equal(b, a, err_msg=name)


def test_as_pipeline_passes() -> None:
    """MemoryOptimize and ReleaseMemory run in a PassManager pipeline (verified after each) on every
    main program of a ProgramSet."""
    from ir.program_set import ProgramSet
    from passes.dist_plan import DistPlan
    from passes.memory_optimize import MemoryOptimize
    from passes.pass_base import PassContext, PassManager
    from passes.release_memory import ReleaseMemory

    main, startup, loss = mlp((4, 4))
    expected = main.clone()
    memory_optimize_program(expected, {"fc_1.tmp_2"}, level=1, skip_grads=True)
    release_memory_program(expected, {"fc_1.tmp_2"})
    programs = ProgramSet()
    programs.add("trainer.0", main, startup)
    ctx = PassContext(main, startup, DistPlan(trainer_id=0, trainers=1, sync_mode=True, pservers=()))
    manager = PassManager([MemoryOptimize(frozenset({"fc_1.tmp_2"}), level=1, skip_grads=True),
                           ReleaseMemory(frozenset({"fc_1.tmp_2"}))])
    assert manager.run(programs, ctx) is True
    assert format_program(programs["trainer.0"].main) == format_program(expected)
    assert manager.run(programs, ctx) is False  # idempotent: nothing left to reuse or release


def test_block_reuse_vars() -> None:
    """The IR mutation the rewrite goes through: uses (slots, op_role_var, unshadowed sub-block uses) move
    onto the kept variable, the other is removed; mismatches are refused before anything changes."""
    from ir.errors import IRError

    p = _chain()
    b = p.global_block()
    b.create_var("i", (-1, 4), dtype="int64")
    sub = p.create_block(0)
    sub._append_raw_op("relu", {"X": ["t2"]}, {"Out": ["t3"]}, {"op_role": 0, "op_role_var": ["t2", "t2"]})
    p.rollback()
    version = p.version
    for mapping, shapes, match in (({"t2": "i"}, None, "same dtype"), ({"t2": "t2"}, None, "for itself"),
                                   ({"t2": "t0", "t0": "t1"}, None, "renamed too"),
                                   ({"t2": "t0"}, {"t0": (4,)}, "rank 2"), ({"nope": "t0"}, None, "no variable")):
        with pytest.raises(IRError, match=match):
            b.reuse_vars(mapping, shapes)
    assert p.version == version
    b.reuse_vars({"t2": "t0"}, {"t0": (-1, -1)})
    assert b.var("t0").shape == (-1, -1) and not b.has_var("t2")
    assert b.ops[2].output("Out") == ["t0"] and b.ops[3].input("X") == ["t0"]
    assert sub.ops[0].input("X") == ["t0"] and sub.ops[0].role_var == ["t0", "t0"]
    assert p.version > version
