"""Schemas of the optimizer, rpc, collective and io op families: for every op a tiny Program is built
with ``ir.core`` APIs, and its inferred shapes, traits and gradient policy are checked; then the
inference errors (Param/Grad mismatch, bad LearningRate, inconsistent endpoint lists…) are matched."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from ir.core import Operator, Program, infer_op
from ir.errors import IRError, RegistryError
from ir.ops.registry import BlockRef, NO_GRAD, get_op_def

# name -> (shape, dtype, type, persistable)
VarSpec = tuple[tuple[int, ...], str, str, bool]
Expected = dict[str, list[tuple[tuple[int, ...], str, str]]]

RAW = ((), "float32", "raw")


def dense(*shape: int, dtype: str = "float32", persistable: bool = False) -> VarSpec:
    return (tuple(shape), dtype, "lod_tensor", persistable)


def param(*shape: int) -> VarSpec:
    return dense(*shape, persistable=True)


def sparse(*shape: int) -> VarSpec:
    return (tuple(shape), "float32", "selected_rows", False)


def raw() -> VarSpec:
    return ((), "float32", "raw", False)


@dataclass
class Case:
    id: str
    op_type: str
    vars: dict[str, VarSpec]
    inputs: dict[str, list[str]]
    outputs: dict[str, list[str]]
    attrs: dict[str, Any] = field(default_factory=dict)
    expect: Expected | None = None  # None: the op declares no shape inference
    traits: frozenset[str] = frozenset()
    has_grad: bool = False


def build(vars: dict[str, VarSpec], op_type: str, inputs: dict[str, list[str]], outputs: dict[str, list[str]],
          attrs: dict[str, Any] | None = None, blocks: int = 0) -> tuple[Program, Operator]:
    """A program whose block 0 holds ``vars`` and one op; ``blocks`` empty sub-blocks are added."""
    program = Program()
    block = program.global_block()
    for name, (shape, dtype, vtype, persistable) in vars.items():
        block.create_var(name, shape, dtype, vtype, persistable=persistable)
    for _ in range(blocks):
        program.create_block(0)
        program.rollback()
    op = block.append_op(op_type, inputs, outputs, attrs)
    return program, op


OPT = frozenset({"optimizer"})
NET = frozenset({"rpc", "host", "side_effect"})
TRAINER_NET = NET | {"trainer_rpc"}
HOST = frozenset({"host"})
IO = frozenset({"host", "side_effect"})

W = param(4, 3)
LR = param(1)


def _optimizer_cases() -> list[Case]:
    acc = {"m1": param(4, 3), "m2": param(4, 3), "b1p": param(1), "b2p": param(1)}
    base = {"w": W, "g": dense(4, 3), "lr": LR}
    same = [((4, 3), "float32", "lod_tensor")]
    return [
        Case("sgd", "sgd", base, {"Param": ["w"], "Grad": ["g"], "LearningRate": ["lr"]}, {"ParamOut": ["w"]},
             expect={"ParamOut": same}, traits=OPT),
        Case("sgd_sparse_grad", "sgd", {**base, "g": sparse(-1, 3)},
             {"Param": ["w"], "Grad": ["g"], "LearningRate": ["lr"]}, {"ParamOut": ["w"]},
             expect={"ParamOut": same}, traits=OPT),
        Case("momentum", "momentum", {**base, "v": param(4, 3)},
             {"Param": ["w"], "Grad": ["g"], "Velocity": ["v"], "LearningRate": ["lr"]},
             {"ParamOut": ["w"], "VelocityOut": ["v"]}, {"mu": 0.9},
             expect={"ParamOut": same, "VelocityOut": same}, traits=OPT),
        Case("adagrad", "adagrad", {**base, "m": param(4, 3)},
             {"Param": ["w"], "Grad": ["g"], "Moment": ["m"], "LearningRate": ["lr"]},
             {"ParamOut": ["w"], "MomentOut": ["m"]}, expect={"ParamOut": same, "MomentOut": same}, traits=OPT),
        Case("adam", "adam", {**base, **acc},
             {"Param": ["w"], "Grad": ["g"], "LearningRate": ["lr"], "Moment1": ["m1"], "Moment2": ["m2"],
              "Beta1Pow": ["b1p"], "Beta2Pow": ["b2p"]},
             {"ParamOut": ["w"], "Moment1Out": ["m1"], "Moment2Out": ["m2"]},
             expect={"ParamOut": same, "Moment1Out": same, "Moment2Out": same}, traits=OPT),
        Case("rmsprop", "rmsprop", {**base, "ms": param(4, 3), "mom": param(4, 3)},
             {"Param": ["w"], "MeanSquare": ["ms"], "LearningRate": ["lr"], "Grad": ["g"], "Moment": ["mom"]},
             {"ParamOut": ["w"], "MomentOut": ["mom"], "MeanSquareOut": ["ms"]},
             expect={"ParamOut": same, "MomentOut": same, "MeanSquareOut": same}, traits=OPT),
        Case("rmsprop_centered", "rmsprop", {**base, "ms": param(4, 3), "mg": param(4, 3), "mom": param(4, 3)},
             {"Param": ["w"], "MeanSquare": ["ms"], "MeanGrad": ["mg"], "LearningRate": ["lr"], "Grad": ["g"],
              "Moment": ["mom"]},
             {"ParamOut": ["w"], "MomentOut": ["mom"], "MeanSquareOut": ["ms"], "MeanGradOut": ["mg"]},
             {"centered": True},
             expect={"ParamOut": same, "MomentOut": same, "MeanSquareOut": same, "MeanGradOut": same}, traits=OPT),
        Case("decayed_adagrad", "decayed_adagrad", {**base, "m": param(4, 3)},
             {"Param": ["w"], "Grad": ["g"], "Moment": ["m"], "LearningRate": ["lr"]},
             {"ParamOut": ["w"], "MomentOut": ["m"]}, expect={"ParamOut": same, "MomentOut": same}, traits=OPT),
        Case("ftrl", "ftrl", {**base, "sq": param(4, 3), "lin": param(4, 3)},
             {"Param": ["w"], "SquaredAccumulator": ["sq"], "LinearAccumulator": ["lin"], "Grad": ["g"],
              "LearningRate": ["lr"]},
             {"ParamOut": ["w"], "SquaredAccumOut": ["sq"], "LinearAccumOut": ["lin"]},
             expect={"ParamOut": same, "SquaredAccumOut": same, "LinearAccumOut": same}, traits=OPT),
        Case("clip", "clip", {"x": dense(-1, 5), "y": dense()}, {"X": ["x"]}, {"Out": ["y"]},
             {"min": -1.0, "max": 1.0}, expect={"Out": [((-1, 5), "float32", "lod_tensor")]}, has_grad=True),
        Case("clip_sparse", "clip", {"x": sparse(10, 5), "y": dense()}, {"X": ["x"]}, {"Out": ["y"]},
             {"min": -1.0, "max": 1.0}, expect={"Out": [((10, 5), "float32", "selected_rows")]}, has_grad=True),
        Case("clip_by_norm", "clip_by_norm", {"x": dense(4, 3), "y": dense()}, {"X": ["x"]}, {"Out": ["y"]},
             {"max_norm": 5.0}, expect={"Out": [((4, 3), "float32", "lod_tensor")]}),
    ]


def _rpc_cases() -> list[Case]:
    eps = ["127.0.0.1:6170", "127.0.0.1:6171"]
    g = {"g0": dense(2, 3), "g1": dense(2, 3), "dep": dense(), "dep2": dense()}
    return [
        Case("send", "send", g, {"X": ["g0", "g1"]}, {"Out": ["dep"]}, {"epmap": eps, "sync_mode": False},
             expect={"Out": [RAW]}, traits=TRAINER_NET),
        Case("send_runtime_split", "send", {"g": dense(4, 3)}, {"X": ["g"]}, {},
             {"epmap": eps, "sections": [2, 2], "send_varnames": ["g.block0", "g.block1"]},
             expect={}, traits=TRAINER_NET),
        Case("recv", "recv", {"dep": raw(), "w0": param(2, 3), "w1": param(2, 3)}, {"X": ["dep"]},
             {"Out": ["w0", "w1"]}, {"epmap": eps, "trainer_id": 1}, expect={}, traits=TRAINER_NET),
        Case("send_barrier", "send_barrier", {"dep": raw(), "bar": dense()}, {"X": ["dep"]}, {"Out": ["bar"]},
             {"endpoints": eps}, expect={"Out": [RAW]}, traits=TRAINER_NET),
        Case("fetch_barrier", "fetch_barrier", {"dep": raw(), "bar": dense()}, {"X": ["dep"]}, {"Out": ["bar"]},
             {"endpoints": eps}, expect={"Out": [RAW]}, traits=TRAINER_NET),
        Case("split_byref", "split_byref", {"g": dense(5, 3), "g0": dense(), "g1": dense()}, {"X": ["g"]},
             {"Out": ["g0", "g1"]}, {"sections": [3, 2]},
             expect={"Out": [((3, 3), "float32", "lod_tensor"), ((2, 3), "float32", "lod_tensor")]}),
        Case("split_selected_rows", "split_selected_rows", {"g": sparse(10, 4), "g0": dense(), "g1": dense()},
             {"X": ["g"]}, {"Out": ["g0", "g1"]}, {"height_sections": [6, 4]},
             expect={"Out": [((6, 4), "float32", "selected_rows"), ((4, 4), "float32", "selected_rows")]},
             traits=HOST),
        Case("split_ids", "split_ids", {"ids": dense(-1, 1, dtype="int64"), "s0": dense(), "s1": dense()},
             {"Ids": ["ids"]}, {"Out": ["s0", "s1"]},
             expect={"Out": [((-1, 1), "int64", "lod_tensor")] * 2}, traits=HOST),
        Case("split_ids_sparse", "split_ids", {"tg": sparse(100, 8), "s0": dense(), "s1": dense()},
             {"Ids": ["tg"]}, {"Out": ["s0", "s1"]},
             expect={"Out": [((100, 8), "float32", "selected_rows")] * 2}, traits=HOST),
        Case("merge_ids", "merge_ids",
             {"ids": dense(-1, 1, dtype="int64"), "r0": dense(-1, 1, dtype="int64"), "r1": dense(-1, 1, dtype="int64"),
              "x0": dense(-1, 8), "x1": dense(-1, 8), "emb": dense()},
             {"Ids": ["ids"], "Rows": ["r0", "r1"], "X": ["x0", "x1"]}, {"Out": ["emb"]},
             expect={"Out": [((-1, 8), "float32", "lod_tensor")]}, traits=HOST),
        Case("prefetch", "prefetch",
             {"i0": dense(-1, 1, dtype="int64"), "i1": dense(-1, 1, dtype="int64"), "o0": dense(), "o1": dense()},
             {"X": ["i0", "i1"]}, {"Out": ["o0", "o1"]},
             {"epmap": eps, "table_names": ["t.block0", "t.block1"], "height_sections": [50, 50]},
             expect={}, traits=TRAINER_NET),
        Case("listen_and_serv", "listen_and_serv", {"g0": dense(2, 3)}, {"X": ["g0"]}, {},
             {"endpoint": eps[0], "Fanin": 2, "optimize_blocks": [BlockRef(1), BlockRef(2)],
              "grad_to_block_id": ["g0:1", "g1@GRAD.block0:2"], "prefetch_var_name_to_block_id": ["ids:3"],
              "pserver_id": 0},
             expect={}, traits=NET),
        Case("lookup_sparse_table", "lookup_sparse_table",
             {"t": param(100, 8), "ids": dense(-1, 1, dtype="int64"), "out": dense()},
             {"W": ["t"], "Ids": ["ids"]}, {"Out": ["out"]},
             expect={"Out": [((-1, 8), "float32", "lod_tensor")]}, traits=IO),
        Case("checkpoint_notify", "checkpoint_notify", {}, {}, {},
             {"epmap": eps, "dir": "/tmp/ckpt", "lookup_table": "t"}, traits=NET),
        Case("geo_sync", "geo_sync",
             {"w": param(4, 3), "b": param(3), "ws": dense(4, 3), "bs": dense(3), "step": dense(1, dtype="int64")},
             {"X": ["w", "b"], "Snapshot": ["ws", "bs"], "Step": ["step"]},
             {"Out": ["w", "b"], "SnapshotOut": ["ws", "bs"], "StepOut": ["step"]},
             {"block_counts": [2, 1], "sections": [2, 2, 3], "epmap": eps + eps[:1],
              "block_names": ["w.block0", "w.block1", "b"], "delta_names": ["w.block0@DELTA", "w.block1@DELTA", "b@DELTA"],
              "push_nums": 4},
             expect={"Out": [((4, 3), "float32", "lod_tensor"), ((3,), "float32", "lod_tensor")],
                     "SnapshotOut": [((4, 3), "float32", "lod_tensor"), ((3,), "float32", "lod_tensor")],
                     "StepOut": [((1,), "int64", "lod_tensor")]}, traits=TRAINER_NET),
    ]


def _collective_cases() -> list[Case]:
    return [
        Case("gen_nccl_id", "gen_nccl_id", {"NCCLID": dense()}, {}, {"NCCLID": ["NCCLID"]},
             {"trainer_id": 0, "endpoint": "127.0.0.1:6170", "other_endpoints": ["127.0.0.1:6171"]},
             expect={"NCCLID": [RAW]}, traits=frozenset({"collective", "host", "side_effect"})),
        Case("c_allreduce_sum", "c_allreduce_sum", {"g": dense(4, 3), "g_out": dense()}, {"X": ["g"]},
             {"Out": ["g_out"]}, expect={"Out": [((4, 3), "float32", "lod_tensor")]},
             traits=frozenset({"collective", "replica_reduce"})),
        Case("c_broadcast", "c_broadcast", {"w": param(4, 3)}, {"X": ["w"]}, {"Out": ["w"]}, {"root": 1},
             expect={"Out": [((4, 3), "float32", "lod_tensor")]}, traits=frozenset({"collective"})),
    ]


def _io_cases() -> list[Case]:
    return [
        Case("delete_var", "delete_var", {"a": dense(2), "b": dense(3)}, {"X": ["a", "b"]}, {}, traits=IO),
        Case("save", "save", {"w": W}, {"X": ["w"]}, {}, {"file_path": "/tmp/w"}, traits=IO),
        Case("load", "load", {"w": W}, {}, {"Out": ["w"]}, {"file_path": "/tmp/w"}, traits=IO),
        Case("fake_init", "fake_init", {"t": dense()}, {}, {"Out": ["t"]}, {"shape": [100, 8]},
             expect={"Out": [((100, 8), "float32", "lod_tensor")]}, traits=IO),
        Case("save_combine", "save_combine", {"w": W, "b": param(3)}, {"X": ["w", "b"]}, {},
             {"file_path": "/tmp/all", "overwrite": False}, traits=IO),
        Case("load_combine", "load_combine", {"w": W, "b": param(3)}, {}, {"Out": ["w", "b"]},
             {"file_path": "/tmp/all"}, traits=IO),
    ]


CASES = _optimizer_cases() + _rpc_cases() + _collective_cases() + _io_cases()

FAMILY_OPS = {
    "sgd", "momentum", "adagrad", "adam", "rmsprop", "decayed_adagrad", "ftrl", "clip", "clip_by_norm",
    "send", "recv", "send_barrier", "fetch_barrier", "split_byref", "split_selected_rows", "split_ids", "merge_ids",
    "prefetch", "listen_and_serv", "lookup_sparse_table", "checkpoint_notify", "geo_sync",
    "gen_nccl_id", "c_allreduce_sum", "c_broadcast",
    "delete_var", "save", "load", "fake_init", "save_combine", "load_combine",
}


def test_every_family_op_has_a_case() -> None:
    assert {c.op_type for c in CASES} == FAMILY_OPS


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_op_schema(case: Case) -> None:
    program, op = build(case.vars, case.op_type, case.inputs, case.outputs, case.attrs, blocks=3)
    op_def = get_op_def(case.op_type)
    assert op_def.traits == case.traits
    assert op_def.has_grad is case.has_grad
    if case.has_grad:
        specs = op_def.make_grad(op)
        assert [s.type for s in specs] == [case.op_type + "_grad"]
    else:
        with pytest.raises(RegistryError, match="has no gradient"):
            op_def.make_grad(op)
    results = infer_op(op)
    if case.expect is None:
        assert op_def.infer is None
        return
    got = {slot: [(i.shape, i.dtype, i.type) for i in infos] for slot, infos in (results or {}).items()}
    assert got == case.expect
    # append_op recorded the inferred info on every non-persistable output variable.
    block = program.global_block()
    for slot, infos in case.expect.items():
        for name, info in zip(op.output(slot), infos):
            var = block.var(name)
            if not var.persistable:
                assert (var.shape, var.dtype, var.type) == info


def test_attr_defaults_follow_fluid() -> None:
    _, adam = build({"w": W, "g": dense(4, 3), "lr": LR, "m1": param(4, 3), "m2": param(4, 3),
                     "b1": param(1), "b2": param(1)}, "adam",
                    {"Param": ["w"], "Grad": ["g"], "LearningRate": ["lr"], "Moment1": ["m1"], "Moment2": ["m2"],
                     "Beta1Pow": ["b1"], "Beta2Pow": ["b2"]},
                    {"ParamOut": ["w"], "Moment1Out": ["m1"], "Moment2Out": ["m2"]})
    assert (adam.attr("beta1"), adam.attr("beta2"), adam.attr("epsilon"), adam.attr("lazy_mode")) == \
        (0.9, 0.999, 1e-8, False)
    _, ls = build({}, "listen_and_serv", {}, {})
    assert (ls.attr("Fanin"), ls.attr("sync_mode"), ls.attr("lr_decay_block_id"), ls.attr("checkpoint_block_id"),
            ls.attr("distributed_mode"), ls.attr("dc_asgd"), ls.attr("optimize_blocks")) == (1, True, -1, -1, 0, False, [])
    _, nccl = build({"id": raw()}, "gen_nccl_id", {}, {"NCCLID": ["id"]})
    assert nccl.attr("nccl_comm_num") == 1


def test_momentum_needs_mu() -> None:
    with pytest.raises(IRError, match="needs attribute 'mu'"):
        build({"w": W, "g": dense(4, 3), "v": param(4, 3), "lr": LR}, "momentum",
              {"Param": ["w"], "Grad": ["g"], "Velocity": ["v"], "LearningRate": ["lr"]},
              {"ParamOut": ["w"], "VelocityOut": ["v"]})


def test_clip_grad_reads_x_and_out_grad() -> None:
    _, op = build({"x": dense(4, 3), "y": dense()}, "clip", {"X": ["x"]}, {"Out": ["y"]}, {"min": 0.0, "max": 1.0})
    (spec,) = get_op_def("clip").make_grad(op)
    assert spec.inputs == {"X": ["x"], "Out@GRAD": ["y@GRAD"]}
    assert spec.outputs == {"X@GRAD": ["x@GRAD"]}
    assert (spec.attrs["min"], spec.attrs["max"]) == (0.0, 1.0)


# --- optimizer inference errors ----------------------------------------------------------------

def _sgd(grad: tuple[tuple[int, ...], str], lr_shape: tuple[int, ...] = (1,)) -> None:
    shape, vtype = grad
    build({"w": W, "g": (shape, "float32", vtype, False), "lr": param(*lr_shape)}, "sgd",
          {"Param": ["w"], "Grad": ["g"], "LearningRate": ["lr"]}, {"ParamOut": ["w"]})


OPTIMIZER_SLOTS: dict[str, tuple[dict[str, list[str]], dict[str, list[str]], dict[str, Any]]] = {
    c.op_type: (c.inputs, c.outputs, c.attrs) for c in _optimizer_cases()
    if "optimizer" in c.traits and c.id == c.op_type
}


def _optimizer_vars(op_type: str, **override: VarSpec) -> dict[str, VarSpec]:
    case = next(c for c in _optimizer_cases() if c.id == op_type)
    return {**case.vars, **override}


@pytest.mark.parametrize("op_type", sorted(OPTIMIZER_SLOTS))
def test_optimizer_rejects_grad_of_another_shape(op_type: str) -> None:
    inputs, outputs, attrs = OPTIMIZER_SLOTS[op_type]
    with pytest.raises(IRError, match=r"Grad has shape \[4, 5\] but Param has shape \[4, 3\]"):
        build(_optimizer_vars(op_type, g=dense(4, 5)), op_type, inputs, outputs, attrs)


@pytest.mark.parametrize("op_type", sorted(OPTIMIZER_SLOTS))
def test_optimizer_rejects_learning_rate_of_many_elements(op_type: str) -> None:
    inputs, outputs, attrs = OPTIMIZER_SLOTS[op_type]
    with pytest.raises(IRError, match=r"LearningRate has shape \[2\], which is not one element") as info:
        build(_optimizer_vars(op_type, lr=param(2)), op_type, inputs, outputs, attrs)
    assert info.value.hint is not None and "one-element" in info.value.hint


def test_optimizer_rejects_accumulator_of_another_shape() -> None:
    inputs, outputs, attrs = OPTIMIZER_SLOTS["adam"]
    with pytest.raises(IRError, match=r"accumulator Moment2 has shape \[3, 4\]"):
        build(_optimizer_vars("adam", m2=param(3, 4)), "adam", inputs, outputs, attrs)


def test_adam_rejects_beta_pow_of_many_elements() -> None:
    inputs, outputs, attrs = OPTIMIZER_SLOTS["adam"]
    with pytest.raises(IRError, match=r"Beta1Pow has shape \[4, 3\]"):
        build(_optimizer_vars("adam", b1p=param(4, 3)), "adam", inputs, outputs, attrs)


def test_selected_rows_grad_compares_rank_and_width_only() -> None:
    _sgd(((2, 3), "selected_rows"))  # fewer rows than Param: a subset, accepted
    _sgd(((4, -1), "lod_tensor"))  # unknown extent matches anything
    _sgd(((4, 3), "lod_tensor"), lr_shape=())  # a scalar is one element
    with pytest.raises(IRError, match=r"selected_rows Grad .* has shape \[2, 5\]"):
        _sgd(((2, 5), "selected_rows"))
    with pytest.raises(IRError, match=r"Grad has shape \[12\]"):
        _sgd(((12,), "lod_tensor"))


def test_centered_rmsprop_needs_mean_grad() -> None:
    case = next(c for c in _optimizer_cases() if c.id == "rmsprop")
    with pytest.raises(IRError, match="centered=true but MeanGrad or MeanGradOut is missing"):
        build(case.vars, "rmsprop", case.inputs, case.outputs, {"centered": True})


# --- rpc inference errors ----------------------------------------------------------------------

def test_send_needs_one_endpoint_per_input() -> None:
    with pytest.raises(IRError, match="attr epmap has 1 entries but there are 2 X variables"):
        build({"a": dense(2), "b": dense(2)}, "send", {"X": ["a", "b"]}, {}, {"epmap": ["127.0.0.1:1"]})
    with pytest.raises(IRError, match="attr sections has 1 entries but there are 2 send_varnames"):
        build({"a": dense(4)}, "send", {"X": ["a"]}, {},
              {"epmap": ["e0", "e1"], "sections": [4], "send_varnames": ["a.block0", "a.block1"]})


def test_recv_needs_one_endpoint_per_output() -> None:
    with pytest.raises(IRError, match="attr epmap has 0 entries but there are 1 Out variables"):
        build({"w": W}, "recv", {}, {"Out": ["w"]})


def test_split_byref_sections_must_tile_rows() -> None:
    vars = {"g": dense(5, 3), "g0": dense(), "g1": dense()}
    with pytest.raises(IRError, match=r"sections \[3, 3\] \(sum 6\) do not tile X's 5 rows"):
        build(vars, "split_byref", {"X": ["g"]}, {"Out": ["g0", "g1"]}, {"sections": [3, 3]})
    with pytest.raises(IRError, match="has 3 entries but there are 2 outputs"):
        build(vars, "split_byref", {"X": ["g"]}, {"Out": ["g0", "g1"]}, {"sections": [1, 2, 2]})
    with pytest.raises(IRError, match="sections is empty"):
        build(vars, "split_byref", {"X": ["g"]}, {"Out": ["g0", "g1"]})


def test_split_selected_rows_heights_must_tile() -> None:
    with pytest.raises(IRError, match=r"height_sections \[6, 6\] \(sum 12\) do not tile X's height 10"):
        build({"g": sparse(10, 4), "g0": dense(), "g1": dense()}, "split_selected_rows", {"X": ["g"]},
              {"Out": ["g0", "g1"]}, {"height_sections": [6, 6]})


def test_merge_ids_needs_one_output_per_ids() -> None:
    with pytest.raises(IRError, match="2 outputs for 1 Ids variables"):
        build({"ids": dense(-1, 1, dtype="int64"), "x": dense(-1, 8), "r": dense(-1, 1), "a": dense(), "b": dense()},
              "merge_ids", {"Ids": ["ids"], "Rows": ["r"], "X": ["x"]}, {"Out": ["a", "b"]})


def test_listen_and_serv_checks_grad_to_block_id() -> None:
    with pytest.raises(IRError, match="entry 'g0' is not of the form 'name:block_idx'"):
        build({}, "listen_and_serv", {}, {}, {"optimize_blocks": [BlockRef(1)], "grad_to_block_id": ["g0"]}, blocks=1)
    with pytest.raises(IRError, match=r"maps 'g0' to block 2, which is not in optimize_blocks \[1\]"):
        build({}, "listen_and_serv", {}, {}, {"optimize_blocks": [BlockRef(1)], "grad_to_block_id": ["g0:2"]},
              blocks=2)


def test_control_dependency_outputs_become_raw() -> None:
    program, _ = build({"a": dense(2), "dep": dense(7, dtype="int64")}, "send", {"X": ["a"]}, {"Out": ["dep"]},
                       {"epmap": ["127.0.0.1:1"]})
    dep = program.global_block().var("dep")
    assert (dep.shape, dep.dtype, dep.type) == RAW


def test_no_grad_ops_never_register_a_grad_op() -> None:
    for op_type in sorted(FAMILY_OPS - {"clip"}):
        assert get_op_def(op_type).grad is NO_GRAD
        with pytest.raises(RegistryError, match="unknown op type"):
            get_op_def(op_type + "_grad")
