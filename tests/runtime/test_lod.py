"""LoD sequences end to end: ``layers.data(..., lod_level=1)``, the feed forms (lists of sequences,
``create_lod_tensor``, ``LoDTensor``, ``DataFeeder``), the bucket-padded representation, the sequence
layers against numpy, the errors that name the fix, and Paddle 1.5's ``test_dist_transpiler`` lookup-table
programs (``lod_level=1`` inputs) transpiled in pserver mode."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

import runtime
from flotilla.fluid import layers, optimizer
from ir.core import Program, program_guard
from ir.errors import FlotillaError, IRError
from ir.names import unique_name
from flotilla.fluid.param_attr import ParamAttr
from ir.verify import verify
from runtime.lod import (DataFeeder, LoDTensor, bucket_rows, create_lod_tensor, expand_lod_feeds, is_lod_var)
from runtime.scope import FeedError, Scope
from transpiler import DistributeTranspiler

SEQS = [[3, 1, 4], [1], [5, 9, 2, 6], []]


def pooled_program(pool_types: tuple[str, ...] = ("sum", "average", "sqrt", "max", "first", "last")
                   ) -> tuple[Program, Program, list[str], str]:
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        words = layers.data("words", shape=[1], dtype="int64", lod_level=1)
        emb = layers.embedding(words, size=[10, 3], param_attr=ParamAttr(name="emb"))
        pools = [layers.sequence_pool(emb, t, pad_value=-7.0).name for t in pool_types]
    return main, startup, pools, "emb"


def np_pool(table: np.ndarray, seqs: list[list[int]], kind: str) -> np.ndarray:
    out = []
    for s in seqs:
        rows = table[s]
        if not s:
            out.append(np.full(table.shape[1], -7.0))
            continue
        out.append({"sum": rows.sum(0), "average": rows.mean(0), "sqrt": rows.sum(0) / np.sqrt(len(s)),
                    "max": rows.max(0), "first": rows[0], "last": rows[-1]}[kind])
    return np.stack(out)


def run_pools(feed: dict[str, Any]) -> tuple[list[np.ndarray], np.ndarray]:
    main, startup, pools, table = pooled_program()
    scope, exe = Scope(), runtime.Executor()
    exe.run(startup, scope=scope)
    outs = exe.run(main, feed=feed, fetch_list=pools, scope=scope)
    return outs, np.asarray(scope.find_var(table))


def test_data_with_lod_level_declares_rows_and_lengths() -> None:
    main, _, _, _ = pooled_program()
    block = main.global_block()
    assert block.var("words").shape == (-1, 1)
    lengths = block.var(layers.seq_len_name("words"))
    assert (lengths.shape, lengths.dtype, lengths.is_data) == ((-1,), "int64", True)
    assert is_lod_var(block, "words")
    for op in block.ops:
        if op.type == "sequence_pool":
            assert op.input("Length") == ["words@SEQ_LEN"]
    verify(main)
    with pytest.raises(IRError, match="lod_level 2"):
        with program_guard(Program(), Program()):
            layers.data("x", shape=[1], dtype="int64", lod_level=2)


@pytest.mark.parametrize("form", ["list", "create_lod_tensor", "LoDTensor", "DataFeeder"])
def test_every_feed_form_pools_like_fluid(form: str) -> None:
    flat = np.asarray([i for s in SEQS for i in s], np.int64).reshape(-1, 1)
    lens = [[len(s) for s in SEQS]]
    if form == "list":
        feed: dict[str, Any] = {"words": SEQS}
    elif form == "create_lod_tensor":
        feed = {"words": create_lod_tensor(SEQS, lens, runtime.CPUPlace())}
    elif form == "LoDTensor":
        t = LoDTensor()
        t.set(flat, runtime.CPUPlace())
        t.set_recursive_sequence_lengths(lens)
        feed = {"words": t}
    else:
        main, _, _, _ = pooled_program()
        feed = DataFeeder(["words"], runtime.CPUPlace(), program=main).feed([(s,) for s in SEQS])
    outs, table = run_pools(feed)
    for kind, got in zip(("sum", "average", "sqrt", "max", "first", "last"), outs):
        np.testing.assert_allclose(got, np_pool(table, SEQS, kind), rtol=1e-5, atol=1e-6, err_msg=kind)


def test_lod_tensor_api_matches_fluid() -> None:
    t = create_lod_tensor(np.arange(5).reshape(5, 1), [[2, 3]], runtime.CPUPlace())
    assert t.recursive_sequence_lengths() == [[2, 3]]
    assert t.lod() == [[0, 2, 5]]
    assert t.shape() == [5, 1]
    np.testing.assert_array_equal(np.array(t), np.arange(5).reshape(5, 1))
    t.set_lod([[0, 1, 5]])
    assert t.recursive_sequence_lengths() == [[1, 4]]
    assert t.has_valid_recursive_sequence_lengths()
    with pytest.raises(FeedError, match="add up to 4 rows; data has 5"):
        create_lod_tensor(np.zeros((5, 1)), [[1, 3]], None)
    with pytest.raises(FeedError, match="do not match"):
        create_lod_tensor([[1, 2], [3]], [[1, 2]], None)


def test_batches_of_one_bucket_have_one_shape() -> None:
    """The compiled step sees the bucket, not the lengths: batches with different lengths but the same
    bucket feed identical shapes (one compilation)."""
    main, _, _, _ = pooled_program()
    block = main.global_block()
    a = expand_lod_feeds(block, {"words": [[1, 2, 3], [4]]})
    b = expand_lod_feeds(block, {"words": [[1], [2, 3, 4, 5, 6]]})
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()} == {
        "words": (8, 1), "words@SEQ_LEN": (2,)}
    np.testing.assert_array_equal(b["words@SEQ_LEN"], [1, 5])
    assert [bucket_rows(n) for n in (0, 1, 8, 9, 16, 17, 1000)] == [8, 8, 8, 16, 16, 32, 1024]


def test_one_compilation_per_bucket() -> None:
    compiles: list[str] = []

    def listen(event: str, duration: float, **kwargs: Any) -> None:
        # a compilation, or its executable loaded from the session's persistent cache (tests/conftest.py)
        if event.endswith(("backend_compile_duration", "compilation_cache/cache_retrieval_time_sec")):
            compiles.append(event)

    main, startup, pools, _ = pooled_program(("sum", "max"))
    scope, exe = Scope(), runtime.Executor()
    exe.run(startup, scope=scope)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        exe.run(main, feed={"words": [[1, 2, 3], [4]]}, fetch_list=pools, scope=scope)
        first = len(compiles)
        for seqs in ([[1], [2, 3, 4, 5, 6]], [[1, 2], [2, 3, 4, 5, 6, 7]], [[], [9] * 8]):  # 8 rows: one bucket
            exe.run(main, feed={"words": seqs}, fetch_list=pools, scope=scope)
        assert len(compiles) == first
        exe.run(main, feed={"words": [[1] * 9, [2]]}, fetch_list=pools, scope=scope)  # 10 rows: bucket 16
        assert len(compiles) == first + 1
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_padding_rows_never_reach_the_pooled_result_or_the_gradient() -> None:
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        words = layers.data("words", shape=[1], dtype="int64", lod_level=1)
        emb = layers.embedding(words, size=[10, 2], param_attr=ParamAttr(name="emb"))
        loss = layers.mean(layers.sequence_pool(emb, "sum"))
        optimizer.SGD(learning_rate=1.0).minimize(loss)
    scope, exe = Scope(), runtime.Executor()
    exe.run(startup, scope=scope)
    before = np.asarray(scope.find_var("emb")).copy()
    exe.run(main, feed={"words": [[3, 4], [4]]}, fetch_list=[loss], scope=scope)  # padded with 6 rows of id 0
    after = np.asarray(scope.find_var("emb"))
    np.testing.assert_array_equal(after[0], before[0])  # id 0 only padded
    np.testing.assert_allclose(before[3] - after[3], [0.25, 0.25], rtol=1e-6)  # d mean / d row = 1 / (N * D)
    np.testing.assert_allclose(before[4] - after[4], [0.5, 0.5], rtol=1e-6)


def test_sequence_softmax_and_conv_run_on_lod_feeds() -> None:
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        words = layers.data("words", shape=[1], dtype="int64", lod_level=1)
        emb = layers.embedding(words, size=[10, 4])
        conv = layers.sequence_conv(emb, num_filters=3, filter_size=3, act="tanh")
        att = layers.sequence_softmax(layers.fc(conv, size=1))
        pooled = layers.sequence_pool(layers.elementwise_mul(conv, att, axis=0), "sum")
        loss = layers.mean(pooled)
        optimizer.SGD(learning_rate=0.1).minimize(loss)
    scope, exe = Scope(), runtime.Executor()
    exe.run(startup, scope=scope)
    att_v, pooled_v = exe.run(main, feed={"words": [[1, 2, 3], [4, 5]]}, fetch_list=[att, pooled], scope=scope)
    np.testing.assert_allclose([att_v[:3].sum(), att_v[3:5].sum()], [1.0, 1.0], rtol=1e-5)
    np.testing.assert_array_equal(att_v[5:], 0)  # bucket padding rows
    assert pooled_v.shape == (2, 3) and np.isfinite(pooled_v).all()


def test_wrong_inputs_name_the_fix() -> None:
    with unique_name.guard(), program_guard(Program(), Program()):
        ids = layers.data("ids", shape=[1], dtype="int64")
        emb = layers.embedding(ids, size=[10, 2])
        with pytest.raises(IRError, match="has no LoD") as e:
            layers.sequence_pool(emb, "sum")
        assert "lod_level=1" in str(e.value)
        with pytest.raises(IRError, match="has no LoD"):
            layers.sequence_softmax(emb)
    main, startup, pools, _ = pooled_program(("sum",))
    exe = runtime.Executor()
    exe.run(startup, scope=Scope())
    with pytest.raises(FeedError, match="needs sequence lengths") as e:
        exe.run(main, feed={"words": np.zeros((4, 1), np.int64)}, fetch_list=pools, scope=Scope())
    assert "create_lod_tensor" in str(e.value)
    plain = Program()
    with program_guard(plain, Program()):
        layers.data("x", shape=[1], dtype="int64")
    with pytest.raises(FeedError, match="declared without them"):
        expand_lod_feeds(plain.global_block(), {"x": create_lod_tensor([[1], [2]], [[1, 1]], None)})
    assert isinstance(FeedError("x"), FlotillaError)


# --- Paddle 1.5 test_dist_transpiler: TestDistLookupTableBase.network_with_table ----------------------------
def network_with_table(is_sparse: bool, is_distributed: bool) -> tuple[Program, Program]:
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        def emb_pool(ids: Any, table_name: str, is_distributed: bool) -> Any:
            emb = layers.embedding(input=ids, size=[1000, 64], dtype="float32", param_attr=table_name,
                                   is_sparse=is_sparse, is_distributed=is_distributed)
            return layers.sequence_pool(input=emb, pool_type="average")

        title_ids = layers.data(name="title_ids", shape=[1], dtype="int64", lod_level=1)
        brand_ids = layers.data(name="brand_ids", shape=[1], dtype="int64", lod_level=1)
        profile_ids = layers.data(name="brand_ids", shape=[1], dtype="int64", lod_level=1)  # sic, as Paddle's
        title_emb = emb_pool(title_ids, "shared_w", is_distributed)
        brand_emb = emb_pool(brand_ids, "shared_w", is_distributed)
        profile_emb = emb_pool(profile_ids, "profile_emb", False)
        fc0 = layers.concat(input=[title_emb, brand_emb, profile_emb], axis=1)
        predict = layers.fc(input=fc0, size=2, act=None, param_attr=ParamAttr(name="fc_w"),
                            bias_attr=ParamAttr(name="fc_b"))
        label = layers.data(name="label", shape=[1], dtype="int64")
        cost = layers.cross_entropy(input=predict, label=label)
        avg_cost = layers.mean(cost)
        optimizer.Adam(learning_rate=0.003).minimize(avg_cost)
    return main, startup


@pytest.mark.parametrize("is_sparse,is_distributed", [(True, True), (True, False), (False, False)],
                         ids=["DistLookupTable", "RemoteLookupTable", "LocalLookupTable"])
def test_paddle_lookup_table_programs_with_lod_inputs_transpile(is_sparse: bool, is_distributed: bool) -> None:
    main, startup = network_with_table(is_sparse, is_distributed)
    t = DistributeTranspiler()
    t.transpile(0, program=main, pservers="127.0.0.1:6174,127.0.0.1:6175", trainers=2, startup_program=startup)
    trainer = t.get_trainer_program()
    ops = trainer.global_block().ops
    pools = [op for op in ops if op.type == "sequence_pool"]
    assert [op.input("Length") for op in pools] == [["title_ids@SEQ_LEN"], ["brand_ids@SEQ_LEN"],
                                                    ["brand_ids@SEQ_LEN"]]
    assert trainer.global_block().var("title_ids@SEQ_LEN").is_data
    assert sum(op.type == "sequence_pool_grad" for op in ops) == 3
    pserver = t.get_pserver_program("127.0.0.1:6174")
    assert pserver.global_block().ops[0].type == "listen_and_serv"
    if is_distributed:
        # Paddle's expected trainer ops, up to the recv of each param block and the concat that joins them.
        types = [op.type for op in ops]
        assert types[:13] == ["split_ids", "prefetch", "merge_ids", "sequence_pool", "sequence_pool", "lookup_table",
                              "sequence_pool", "concat", "mul", "elementwise_add", "cross_entropy", "mean",
                              "fill_constant"]
        assert "lookup_sparse_table" in [op.type for b in pserver.blocks for op in b.ops]
    for ep in ("127.0.0.1:6174", "127.0.0.1:6175"):
        t.get_startup_program(ep, t.get_pserver_program(ep))
