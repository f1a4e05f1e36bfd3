"""A pserver applies a request's (async) or a step's (sync) optimize blocks in one compiled call.

``Executor.run_blocks`` plans an independent set of sub-blocks as one plan; these tests check that its
result is bit for bit what running the blocks one by one gives (a pserver program with Adam or Momentum,
a learning-rate decay block, dense parameters and a distributed sparse table), that a dependent set is
refused naming the variable, and that ``PServer`` serves through it: async batches and sync steps give
the same state as the block-by-block pserver, and an async batch whose merged update is non-finite is
refused as a whole with every variable untouched.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
import pytest

import runtime
from flotilla.fluid import layers, optimizer
from flotilla.fluid.param_attr import ParamAttr
from ir.core import Program, program_guard
from ir.names import unique_name
from runtime.rpc.pserver import BarrierKind, PServer, PServerError, Status
from runtime.rpc.wire import decode_variable, encode_variable
from runtime.scope import ExecutionError, Scope, SelectedRows
from tests.runtime.rpc.conftest import LR, PARAMS, PSHandle, inc, listen_op, small_fc
from transpiler import DistributeTranspiler, DistributeTranspilerConfig

ENDPOINT = "127.0.0.1:6174"
TABLE_ROWS = 64
EMB = 4


def _pserver_program(opt: str, sync: bool) -> tuple[Program, Program]:
    """ids → sparse embedding[64, 4] (a distributed table under Adam; Momentum has no sparse table update, so
    there a sparse-gradient parameter) ++ x[8] → fc 6 relu → fc 1 → square error, ``opt`` with an
    exponentially decaying learning rate, for 2 trainers and one pserver: its (main, startup)."""
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        ids = layers.data(name="ids", shape=[1], dtype="int64")
        x = layers.data(name="x", shape=[8], dtype="float32")
        emb = layers.embedding(ids, size=[TABLE_ROWS, EMB], is_sparse=True, is_distributed=opt == "adam",
                               param_attr=ParamAttr(name="emb"))
        h = layers.fc(layers.concat([layers.reshape(emb, [-1, EMB]), x], axis=1), size=6, act="relu")
        pred = layers.fc(h, size=1)
        y = layers.data(name="y", shape=[1], dtype="float32")
        loss = layers.mean(layers.square_error_cost(input=pred, label=y))
        lr = layers.exponential_decay(0.1, 2, 0.5)
        (optimizer.Adam(lr) if opt == "adam" else optimizer.Momentum(lr, 0.9)).minimize(loss)
    t = DistributeTranspiler(DistributeTranspilerConfig())
    t.transpile(0, program=main, startup_program=startup, pservers=ENDPOINT, trainers=2, sync_mode=sync)
    return t.get_pserver_programs(ENDPOINT)


_PROGRAMS: dict[tuple[str, bool], tuple[Program, Program, runtime.Executor]] = {}


def _programs(opt: str, sync: bool) -> tuple[Program, Program, runtime.Executor]:
    key = (opt, sync)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = (*_pserver_program(opt, sync), runtime.Executor())
    return _PROGRAMS[key]


def _host(value: Any) -> Any:
    if isinstance(value, SelectedRows):
        return SelectedRows(np.array(value.rows, copy=True), np.array(value.values, copy=True), value.height)
    return np.array(value, copy=True)


def _snapshot(scope: Scope) -> dict[str, tuple[str, bytes, bytes]]:
    out = {}
    for name in sorted(scope.local_var_names()):
        v = _host(scope.find_var(name))
        if isinstance(v, SelectedRows):
            out[name] = (str(v.values.dtype), v.values.tobytes(), v.rows.tobytes())
        else:
            out[name] = (str(v.dtype), v.tobytes(), b"")
    return out


def _twin_scopes(exe: runtime.Executor, startup: Program) -> tuple[Scope, Scope]:
    """Two scopes holding the same initialised values (one startup run, copied)."""
    a, b = Scope(), Scope()
    exe.run(startup, scope=a)
    for name in a.local_var_names():
        b.set_var(name, _host(a.find_var(name)))
    return a, b


def _gradients(program: Program, seed: int, sparse_rows: int = 5, padded: bool = True) -> dict[str, Any]:
    """A value for every gradient the pserver receives: dense normals, and selected rows of the table (with
    ``padded``, padded to 8 rows with the padding row ``height`` as the pserver pads them; sent, not)."""
    rng = np.random.default_rng(seed)
    block = program.global_block()
    out: dict[str, Any] = {}
    for name in listen_op(program).input("X"):
        var = block.var(name)
        if var.type == "selected_rows":
            total = max(8, sparse_rows)
            rows = np.concatenate([rng.choice(TABLE_ROWS, sparse_rows, replace=False),
                                   np.full(total - sparse_rows, TABLE_ROWS)]).astype(np.int64)
            values = rng.normal(size=(total, EMB)).astype(np.float32)
            values[sparse_rows:] = 0
            keep = total if padded else sparse_rows
            out[name] = SelectedRows(rows[:keep], values[:keep], TABLE_ROWS)
        else:
            out[name] = rng.normal(size=var.shape).astype(np.float32)
    return out


def _optimize_blocks(program: Program) -> tuple[int, ...]:
    return tuple(b.idx for b in listen_op(program).attr("optimize_blocks"))


@pytest.mark.parametrize("opt", ["adam", "momentum"])
def test_run_blocks_equals_running_the_blocks_one_by_one_bit_for_bit(opt: str) -> None:
    program, startup, exe = _programs(opt, True)
    blocks = _optimize_blocks(program)
    assert len(blocks) >= 6 and blocks[0] == listen_op(program).attr("lr_decay_block_id")
    one_by_one, merged = _twin_scopes(exe, startup)
    for step in range(3):  # the decaying learning rate and the accumulators change every step
        for scope in (one_by_one, merged):
            for name, value in _gradients(program, step).items():
                scope.set_var(name, value)
        for idx in blocks:
            exe.run_block(program, idx, one_by_one)
        exe.run_blocks(program, blocks, merged)
        assert _snapshot(merged) == _snapshot(one_by_one)
    # The set is one plan of one pure run: one compiled call for every block's ops.
    (plan,) = [p for key, p in exe._plans[program].items() if key[1] == blocks]
    assert len(plan.steps) == 1 and len(plan.steps[0].ops) == sum(len(program.block(i).ops) for i in blocks)


def test_run_blocks_checks_the_new_values_in_its_call_and_donates_nothing_it_keeps() -> None:
    program, startup, exe = _programs("adam", True)
    blocks = _optimize_blocks(program)
    scope, reference = _twin_scopes(exe, startup)
    params = [n for n, v in program.global_block().vars.items() if v.is_parameter and n != "emb"]
    grads = _gradients(program, 7)
    first = next(n for n in grads if program.global_block().var(n).type != "selected_rows")
    grads[first] = np.full_like(grads[first], np.inf)  # its parameter's update turns NaN/Inf
    for target in (scope, reference):
        for name, value in grads.items():
            target.set_var(name, value)
    originals = {p: scope.find_var(p) for p in params}
    bad = exe.run_blocks(program, blocks, scope, keep=frozenset(params), check=frozenset(params))
    for idx in blocks:
        exe.run_block(program, idx, reference)
    assert _snapshot(scope) == _snapshot(reference)  # the same values, checked or not
    want = [p for p in params if not np.isfinite(np.asarray(reference.find_var(p))).all()]
    assert want and bad == want
    for p, value in originals.items():  # kept: the buffers handed in are still alive and unchanged
        assert not value.is_deleted()


@pytest.mark.parametrize("blocks,named", [((3, 1), "'tmp_4'"), ((2, 2), "appear more than once"),
                                          ((0, 2), "not all sub-blocks")])
def test_run_blocks_refuses_blocks_that_depend_on_each_other(blocks: tuple[int, ...], named: str) -> None:
    program, startup, exe = _programs("adam", True)
    scope, _ = _twin_scopes(exe, startup)
    before = _snapshot(scope)
    with pytest.raises(ExecutionError) as info:
        exe.run_blocks(program, blocks, scope)
    assert info.value.code == "E689"
    assert f"Executor.run_blocks of blocks {list(blocks)}" in info.value.message and named in info.value.message
    assert "cannot run as one plan" in info.value.message and info.value.hint
    assert _snapshot(scope) == before


def _pserver(opt: str, sync: bool, merged: bool) -> tuple[PServer, Scope, Program]:
    program, startup, exe = _programs(opt, sync)
    scope = Scope()
    exe.run(startup, scope=scope)
    ps = PServer(program, scope, listen_op(program), lambda idx, s: exe.run_block(program, idx, s),
                 run_blocks=(lambda ids, s, **kw: exe.run_blocks(program, ids, s, **kw)) if merged else None,
                 authenticated=True)
    for t in (0, 1):
        ps.announce(t, inc(t))
    return ps, scope, program


def _msg(name: str, value: Any, trainer_id: int, step: int, seq: int) -> Any:
    return decode_variable(encode_variable(name, value, trainer_id=trainer_id, step=step, seq=seq,
                                           incarnation=inc(trainer_id)))


def _copy_startup_values(src: Scope, dst: Scope) -> None:
    for name in src.local_var_names():
        dst.set_var(name, _host(src.find_var(name)))


def test_async_batches_through_one_call_match_the_block_by_block_pserver() -> None:
    """Requests with and without the learning-rate trigger gradient, from both trainers: the merged pserver's
    every variable equals the block-by-block one's (the lr block runs first in the same call)."""
    merged, m_scope, program = _pserver("adam", False, True)
    plain, p_scope, _ = _pserver("adam", False, False)
    _copy_startup_values(m_scope, p_scope)
    names = list(listen_op(program).input("X"))
    trigger = names[0]  # the first gradient's block advances the learning rate (async)
    requests = [(0, names), (1, names[1:]), (0, [trigger, names[2]]), (1, names)]
    seqs = {(t, n): 0 for t in (0, 1) for n in names}
    for step, (t, sent) in enumerate(requests):
        grads = _gradients(program, 10 + step, sparse_rows=3 + step, padded=False)
        batch = []
        for n in sent:
            seqs[t, n] += 1
            batch.append((n, grads[n], seqs[t, n]))
        for ps in (merged, plain):
            ps.send_batch([_msg(n, v, t, step, seq) for n, v, seq in batch])
        assert _snapshot(m_scope) == _snapshot(p_scope), f"after request {step}"
    assert merged.steps_run == plain.steps_run == sum(len(s) for _, s in requests)
    assert [blocks for blocks, one_call in merged._merged.items() if one_call] == [
        (1, 2, 3, 4, 5, 6), (3, 4, 5, 6), (1, 2, 4)]  # the lr block first when the trigger's block is in


def test_dc_asgd_batches_through_one_call_match_the_block_by_block_pserver() -> None:
    """DC-ASGD: every block of a request reads the sender's TRAINER_ID_VAR and its own backups (set by gets)."""
    main, startup = small_fc()
    t = DistributeTranspiler(DistributeTranspilerConfig(min_block_size=100, enable_dc_asgd=True))
    t.transpile(0, program=main, startup_program=startup, pservers=f"{ENDPOINT},127.0.0.1:1", trainers=2,
                sync_mode=False)
    program, pstartup = t.get_pserver_programs(ENDPOINT)
    exe = runtime.Executor()
    servers = []
    for merged in (True, False):
        scope = Scope()
        exe.run(pstartup, scope=scope)
        ps = PServer(program, scope, listen_op(program), lambda idx, s: exe.run_block(program, idx, s),
                     run_blocks=(lambda ids, s, **kw: exe.run_blocks(program, ids, s, **kw)) if merged else None)
        for tr in (0, 1):
            ps.announce(tr, inc(tr))
        servers.append((ps, scope))
    _copy_startup_values(servers[0][1], servers[1][1])
    names = list(listen_op(program).input("X"))
    block = program.global_block()
    rng = np.random.default_rng(5)
    seqs = {0: 0, 1: 0}
    for tr in [0, 1, 1, 0]:
        seqs[tr] += 1
        grads = {n: rng.normal(size=block.var(n).shape).astype(np.float32) for n in names}
        for ps, _ in servers:
            ps.get_many(tr, list(PARAMS))  # DC-ASGD backs up what the trainer fetched
            ps.send_batch([_msg(n, grads[n], tr, seqs[tr], seqs[tr]) for n in names])
        assert _snapshot(servers[0][1]) == _snapshot(servers[1][1])
    assert any(servers[0][0]._merged.values())


def test_a_sync_step_through_one_call_matches_the_block_by_block_pserver() -> None:
    merged, m_scope, program = _pserver("momentum", True, True)
    plain, p_scope, _ = _pserver("momentum", True, False)
    _copy_startup_values(m_scope, p_scope)
    block = program.global_block()
    for ps in (merged, plain):
        for t in (0, 1):
            grads = _gradients(program, 20 + t, padded=False)
            ps.send_batch([_msg(n, grads[n], t, 0, 1) for n in listen_op(program).input("X")
                           if block.var(n).trainer_id in (None, t)])
        # Both SEND barriers: the second one in runs the step (one call), and both return.
        first = threading.Thread(target=ps.barrier, args=(0, 0, BarrierKind.SEND, inc(0)), daemon=True)
        first.start()
        ps.barrier(1, 0, BarrierKind.SEND, inc(1))
        first.join(10.0)
        assert not first.is_alive() and ps.steps_run == 1
    assert _snapshot(m_scope) == _snapshot(p_scope)


def test_an_async_batch_whose_merged_update_overflows_is_refused_whole(make_pserver: Callable[..., PSHandle]) -> None:
    """fc_b near float32's maximum overflows; fc_w.block1's finite update in the same request is refused with it."""
    h = make_pserver(False)
    h.scope.set_var("fc_b", np.full(30, 3.3e38, np.float32))
    before = h.snapshot()
    rng = np.random.default_rng(3)
    batch = [_msg(h.grad_name("fc_w.block1", 0), rng.normal(size=(20, 30)).astype(np.float32), 0, 0, 1),
             _msg(h.grad_name("fc_b", 0), np.full(30, -3e38, np.float32), 0, 0, 1)]
    with pytest.raises(PServerError) as info:
        h.pserver.send_batch(batch)
    assert info.value.status is Status.INVALID_ARGUMENT
    assert ("send batch of ['fc_w@GRAD.block1', 'fc_b@GRAD'] from trainer 0 for step 0: applying it makes 'fc_b' "
            "hold 30 NaN or Inf value(s) although every gradient is finite; the request is refused as a whole, "
            "the parameters are unchanged") in info.value.message
    assert h.snapshot() == before
    assert h.pserver.health()["rejected_nonfinite"] == 1 and h.pserver.steps_run == 0
    g = rng.normal(size=(20, 30)).astype(np.float32)  # the pserver goes on applying
    h.pserver.send_batch([_msg(h.grad_name("fc_w.block1", 0), g, 0, 1, 2),
                          _msg(h.grad_name("fc_b", 0), np.ones(30, np.float32), 0, 1, 2)])
    w_before = np.frombuffer(before["fc_w.block1"][2], np.float32).reshape(20, 30)
    np.testing.assert_allclose(h.params()["fc_w.block1"], w_before - np.float32(LR) * g, rtol=1e-6, atol=1e-7)


def test_a_refused_async_request_leaves_its_table_rows_applied_and_everything_else_untouched() -> None:
    """The table and its accumulators are updated in place, outside the check (their old buffers are donated):
    a request refused for a dense parameter's update still commits them, and every other variable is as before."""
    ps, scope, program = _pserver("adam", False, True)
    names = list(listen_op(program).input("X"))
    table_grad = next(n for n in names if program.global_block().var(n).type == "selected_rows")
    dense = next(n for n in names if n != table_grad)
    grads = _gradients(program, 30, padded=False)
    grads[dense] = np.full_like(grads[dense], 3e38)  # finite; its squared moment is not
    before = _snapshot(scope)
    with pytest.raises(PServerError) as info:
        ps.send_batch([_msg(n, grads[n], 0, 0, 1) for n in (dense, table_grad)])
    assert info.value.status is Status.INVALID_ARGUMENT and "moment2" in info.value.message
    assert "the request is refused as a whole" in info.value.message
    after = _snapshot(scope)
    table_state = {n for n in after if n == "emb" or n.startswith("emb_")}
    assert {n for n in after if after[n] != before.get(n)} <= table_state and after["emb"] != before["emb"]
    assert not scope.find_var("emb").is_deleted()


def test_merged_requests_compile_once_per_padded_row_count() -> None:
    """Selected rows vary per request; padded to powers of two they give the merged call a few signatures."""
    ps, scope, program = _pserver("adam", False, True)
    names = list(listen_op(program).input("X"))
    table_grad = next(n for n in names if program.global_block().var(n).type == "selected_rows")
    ps.send_batch([_msg(names[0], _gradients(program, 40)[names[0]], 0, 0, 1)])  # the learning rate's first step
    sent = [names[1], table_grad]  # not the learning-rate trigger: the same set every request
    for seq, rows in enumerate([3, 4, 5, 6, 7, 9], start=1):  # padded: 4, 4, 8, 8, 8, 16
        grads = _gradients(program, 40 + seq, sparse_rows=rows, padded=False)
        ps.send_batch([_msg(n, grads[n], 0, seq, seq) for n in sent])
    merged = tuple(sorted(ps._grad_block[n] for n in sent))
    assert ps._merged[merged]
    (plan,) = [p for key, p in _programs("adam", False)[2]._plans[program].items() if key[1] == merged]
    assert plan.runs == 6 and plan.steps[0].fn._cache_size() == 3
