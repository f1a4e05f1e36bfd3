"""Cross-program verifier tests: ``cross_program_problems`` / ``verify_program_set`` on transpiled
ProgramSets, clean and corrupted.

Each negative test transpiles a valid model, corrupts a copy of the ProgramSet in one way (a pserver's
optimize block dropped, a slice duplicated, a slice offset changed, a send retargeted, ...) and matches
the verifier's problem codes and messages.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

import ir
from flotilla.fluid import layers, optimizer
from flotilla.fluid.param_attr import ParamAttr
from ir.core import Program
from ir.errors import VerifyError
from ir.program_set import ProgramSet
from ir.verify import MAX_MESSAGE_BYTES, Code, Problem, cross_program_problems, verify_program_set
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, HashName

EP0, EP1, EP2 = "127.0.0.1:6174", "127.0.0.1:6175", "127.0.0.1:6176"
PS0, PS1 = f"pserver@{EP0}", f"pserver@{EP1}"


@pytest.fixture(autouse=True)
def fresh_names() -> Iterator[None]:
    with ir.unique_name.guard():
        yield


def build_fc(make_opt: Callable[[], Any] = lambda: optimizer.SGD(0.1), width: int = 1000,
             out: int = 1000) -> tuple[Program, Program]:
    """TestBasicModel's network: x[width] → fc out (fc_w, fc_b) → square_error_cost → mean."""
    main, startup = Program(), Program()
    with ir.program_guard(main, startup):
        x = layers.data("x", [width])
        y = layers.data("y", [out])
        pred = layers.fc(x, out, param_attr=ParamAttr(name="fc_w"), bias_attr=ParamAttr(name="fc_b"))
        loss = layers.mean(layers.square_error_cost(pred, y))
        make_opt().minimize(loss)
    return main, startup


def transpile(main: Program, startup: Program, pservers: str = f"{EP0},{EP1}", trainers: int = 2,
              sync_mode: bool = True, config: DistributeTranspilerConfig | None = None) -> ProgramSet:
    t = DistributeTranspiler(config)
    t.transpile(0, main, pservers=pservers, trainers=trainers, sync_mode=sync_mode, startup_program=startup)
    return t.program_set


@pytest.fixture
def basic() -> ProgramSet:
    """fc_w (1000×1000) in two slices: block0 on 6175, block1 on 6174 with fc_b; two sync trainers."""
    return transpile(*build_fc())


def codes(problems: list[Problem]) -> list[str]:
    return [p.code for p in problems]


def only(problems: list[Problem], code: str) -> list[Problem]:
    return [p for p in problems if p.code == code]


def op_index(program: Program, block: int, op_type: str, **match: Any) -> int:
    for i, op in enumerate(program.blocks[block].ops):
        if op.type == op_type and all(op.attrs.get(k) == v for k, v in match.items()):
            return i
    raise LookupError(f"no {op_type} in block {block} matching {match}")


# --- clean sets ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_opt, pservers, trainers, sync, config",
    [
        (lambda: optimizer.SGD(0.1), f"{EP0},{EP1}", 2, True, None),
        (lambda: optimizer.SGD(0.1), EP0, 1, True, None),
        (lambda: optimizer.Adam(0.01), f"{EP0},{EP1},{EP2}", 4, True, None),
        (lambda: optimizer.Momentum(0.1, 0.9), f"{EP0},{EP1},{EP2}", 3, False, None),
        (lambda: optimizer.RMSProp(0.1), f"{EP0},{EP1}", 2, True, DistributeTranspilerConfig(split_method=HashName)),
        (lambda: optimizer.Adagrad(0.1), f"{EP0},{EP1}", 2, True, DistributeTranspilerConfig(slice_var_up=False)),
    ],
)
@pytest.mark.filterwarnings("ignore:pserver .* holds no parameter block")
def test_transpiled_sets_are_clean(make_opt: Callable[[], Any], pservers: str, trainers: int, sync: bool,
                                   config: DistributeTranspilerConfig | None) -> None:
    programs = transpile(*build_fc(make_opt), pservers=pservers, trainers=trainers, sync_mode=sync, config=config)
    assert cross_program_problems(programs) == []
    verify_program_set(programs)


def test_clean_basic_has_sliced_param(basic: ProgramSet) -> None:
    # The corruptions below rely on this layout; fail loudly if the transpiler changed it.
    held0 = basic[PS0].main.global_block().vars
    held1 = basic[PS1].main.global_block().vars
    assert (held0["fc_w.block1"].slice_offset, held0["fc_w.block1"].shape) == (500, (500, 1000))
    assert (held1["fc_w.block0"].slice_offset, held1["fc_w.block0"].shape) == (0, (500, 1000))
    assert "fc_b" in held0
    assert cross_program_problems(basic) == []


# --- corruptions ---------------------------------------------------------------------------------------


def test_dropped_optimize_block(basic: ProgramSet) -> None:
    ps = basic[PS0].main
    serv = ps.global_block().ops[op_index(ps, 0, "listen_and_serv")]
    kept = [e for e in serv.attr("grad_to_block_id") if not e.startswith("fc_w@GRAD.block1:")]
    serv.set_attr("grad_to_block_id", kept)
    block = ps.blocks[2]
    block.remove_op(op_index(ps, 2, "sgd"))
    problems = cross_program_problems(basic)
    assert sorted(set(codes(problems))) == [Code.SEND_NOT_RECEIVED, Code.PARAM_NOT_OPTIMIZED]
    sent = only(problems, Code.SEND_NOT_RECEIVED)
    assert len(sent) == 1
    assert sent[0].where.startswith("trainer.0/block 0/op ")
    assert "'fc_w@GRAD.block1.trainer_0' (a copy of 'fc_w@GRAD.block1') sent to 127.0.0.1:6174" in sent[0].found
    assert "does not receive it" in sent[0].found
    assert sent[0].hint
    lost = only(problems, Code.PARAM_NOT_OPTIMIZED)
    assert [p.where for p in lost] == [f"{PS0}/block 0"]
    assert "'fc_w.block1' (of parameter 'fc_w') held but updated by no optimizer op" in lost[0].found


def test_missing_pserver_role(basic: ProgramSet) -> None:
    partial = ProgramSet()
    for role, progs in basic.items():
        if role != PS1:
            partial.add(role, progs.main, progs.startup)
    problems = cross_program_problems(partial)
    no_ps = only(problems, Code.SEND_NO_PSERVER)
    assert len(no_ps) == 1
    assert "'fc_w@GRAD.block0.trainer_0' sent to '127.0.0.1:6175', which has no pserver program" in no_ps[0].found
    gaps = only(problems, Code.SLICE_GAP)
    assert any("rows [0, 500) of 'fc_w' are in no slice" in p.found for p in gaps), gaps


def test_duplicated_slice(basic: ProgramSet) -> None:
    ps0, ps1 = basic[PS0].main, basic[PS1].main
    g1 = ps1.global_block()
    g1.add_var(ps0.global_block().var("fc_w.block1"))
    g1.add_var(ps0.global_block().var("fc_w@GRAD.block1"))
    extra = ps1.create_block(0)
    extra.append_op("sgd", {"Param": "fc_w.block1", "Grad": "fc_w@GRAD.block1",
                            "LearningRate": ps1.global_block().vars["learning_rate_0"].name},
                    {"ParamOut": "fc_w.block1"}, {"op_role": int(ir.OpRole.OPTIMIZE)})
    ps1.rollback()
    problems = cross_program_problems(basic)
    twice = only(problems, Code.PARAM_OPTIMIZED_TWICE)
    assert len(twice) == 1
    assert twice[0].found == (f"'fc_w.block1' (of parameter 'fc_w') optimized 2 times: {PS0} block 2, "
                              f"{PS1} block 2")
    assert twice[0].where == f"{PS1}/block 2/op 0 (optimizer)"
    overlap = only(problems, Code.SLICE_OVERLAP)
    assert any(f"'fc_w.block1' rows [500, 1000) on {PS1} overlaps 'fc_w.block1' on {PS0}" in p.found
               for p in overlap), overlap


def test_changed_slice_offset(basic: ProgramSet) -> None:
    basic[PS0].main.global_block().replace_var("fc_w.block1", slice_offset=400)
    problems = cross_program_problems(basic)
    assert sorted(set(codes(problems))) == [Code.SLICE_GAP, Code.SLICE_OVERLAP]
    (overlap,) = only(problems, Code.SLICE_OVERLAP)
    assert overlap.found == (f"'fc_w.block1' rows [400, 900) on {PS0} overlaps 'fc_w.block0' on {PS1} "
                             "(rows [400, 500) of 'fc_w' held twice)")
    assert overlap.expected == "the next slice of 'fc_w' to start at row 500"
    (gap,) = only(problems, Code.SLICE_GAP)
    assert gap.found == "rows [900, 1000) of 'fc_w' are in no slice"


@pytest.mark.parametrize("attr,code", [("epmap", Code.SEND_NOT_RECEIVED), ("table_epmap", Code.SEND_NO_PSERVER)])
def test_retargeted_geo_delta(attr: str, code: str) -> None:
    """A Geo-SGD trainer's geo_sync sends its deltas itself: each must reach a pserver that adds it (the
    dense blocks' deltas swapped between the pservers; the table's second shard sent to no pserver)."""
    from tests.passes.ctr_model import build_ctr

    config = DistributeTranspilerConfig(geo_sgd_mode=True, geo_sgd_need_push_nums=2)
    ps = transpile(*build_ctr("sgd"), sync_mode=False, config=config)
    assert cross_program_problems(ps) == []
    main = ps["trainer.0"].main
    i = op_index(main, 0, "geo_sync")
    sync = main.global_block().ops[i]
    sync.set_attr(attr, list(reversed(sync.attr(attr))) if attr == "epmap" else [EP0, EP2])
    problems = cross_program_problems(ps)
    assert problems and codes(problems) == [code] * len(problems)
    assert problems[0].where == f"trainer.0/block 0/op {i} (geo_sync)"
    assert "@DELTA" in problems[0].found


def test_retargeted_send(basic: ProgramSet) -> None:
    main = basic["trainer.0"].main
    i = op_index(main, 0, "send", epmap=[EP0])
    main.global_block().ops[i].set_attr("epmap", [EP1])
    problems = cross_program_problems(basic)
    assert codes(problems) == [Code.SEND_NOT_RECEIVED]
    assert problems[0].where == f"trainer.0/block 0/op {i} (send)"
    assert problems[0].found == ("'fc_b@GRAD.trainer_0' (a copy of 'fc_b@GRAD') sent to 127.0.0.1:6175, whose "
                                 "listen_and_serv does not receive it (grad_to_block_id names ['fc_w@GRAD.block0'])")
    assert problems[0].block == 0 and problems[0].op == i


def test_slice_with_wrong_width(basic: ProgramSet) -> None:
    basic[PS1].main.global_block().replace_var("fc_w.block0", shape=(500, 999))
    problems = cross_program_problems(basic)
    shape = only(problems, Code.SLICE_SHAPE)
    assert [p.found for p in shape] == ["slice 'fc_w.block0' of 'fc_w' shaped float32[500, 999]"]
    assert shape[0].expected == "float32[rows, 1000] (rows of 'fc_w', float32[1000, 1000])"


def test_slice_index_out_of_order(basic: ProgramSet) -> None:
    basic[PS0].main.global_block().replace_var("fc_w.block1", slice_index=0)
    problems = cross_program_problems(basic)
    assert codes(problems) == [Code.SLICE_INDEX]
    assert problems[0].found == "slice 'fc_w.block1' of 'fc_w' with slice_index 0"
    assert problems[0].expected == "slice_index 1 (its position by offset)"


def test_sent_shape_disagrees_with_pserver(basic: ProgramSet) -> None:
    basic[PS0].main.global_block().replace_var("fc_b@GRAD.trainer_0", shape=(999,))
    problems = cross_program_problems(basic)
    assert codes(problems) == [Code.SEND_SHAPE]
    assert problems[0].found == "'fc_b@GRAD.trainer_0' sent as float32[1000]"
    assert problems[0].expected == f"float32[999], as {PS0} declares 'fc_b@GRAD.trainer_0'"


def test_listen_and_serv_endpoint_mismatch(basic: ProgramSet) -> None:
    ps = basic[PS0].main
    ps.global_block().ops[op_index(ps, 0, "listen_and_serv")].set_attr("endpoint", EP2)
    problems = cross_program_problems(basic)
    assert codes(problems) == [Code.PSERVER_SERV]
    assert problems[0].found == f"endpoint={EP2!r}"


def test_verify_program_set_reports_cross_problems_with_context(basic: ProgramSet) -> None:
    main = basic["trainer.0"].main
    i = op_index(main, 0, "send", epmap=[EP0])
    main.global_block().ops[i].set_attr("epmap", [EP1])
    with pytest.raises(VerifyError) as info:
        verify_program_set(basic)
    assert [p.code for p in info.value.problems] == [Code.SEND_NOT_RECEIVED]
    text = str(info.value)
    assert "1 problem(s) found by the verifier" in text
    assert ">>   op send(X=[fc_b@GRAD.trainer_0])" in text  # the IR window marks the bad send


# --- message size --------------------------------------------------------------------------------------


def test_message_limit_constant() -> None:
    assert MAX_MESSAGE_BYTES == 2**31 - 1


def test_unsliced_block_over_the_message_limit_is_rejected() -> None:
    # fc_w is 23171 × 23171 float32 = 2.147e9 bytes, just over 2 GiB - 1; programs hold no data.
    main, startup = build_fc(width=23171, out=23171)
    with pytest.raises(VerifyError) as info:
        transpile(main, startup, config=DistributeTranspilerConfig(slice_var_up=False))
    big = [p for p in info.value.problems if p.code == Code.MESSAGE_TOO_LARGE]
    assert big, info.value.problems
    assert any("'fc_w' (float32[23171, 23171]) of 2147580964 bytes" in p.found for p in big)
    assert all(p.expected == f"at most {MAX_MESSAGE_BYTES} bytes (the gRPC message limit)" for p in big)
    # Sliced over two pservers, each block is about 1 GiB and fits.
    assert cross_program_problems(transpile(main, startup)) == []


def test_pserver_without_listen_and_serv(basic: ProgramSet) -> None:
    ps = basic[PS1].main
    ps.global_block().remove_op(op_index(ps, 0, "listen_and_serv"))
    problems = only(cross_program_problems(basic), Code.SEND_NOT_RECEIVED)
    assert [p.found for p in problems] == [
        "'fc_w@GRAD.block0.trainer_0' sent to 127.0.0.1:6175, whose program has no listen_and_serv op"]


def test_two_listen_and_serv_ops(basic: ProgramSet) -> None:
    ps = basic[PS1].main
    serv = ps.global_block().ops[op_index(ps, 0, "listen_and_serv")]
    ps.global_block().append_op("listen_and_serv", dict(serv.inputs), {}, dict(serv.attrs))
    problems = cross_program_problems(basic)
    assert codes(problems) == [Code.PSERVER_SERV]
    assert problems[0].found == "2 listen_and_serv ops"
