"""The pserver state machine (runtime.rpc.pserver.PServer) driven directly, without gRPC, on the transpiled
pserver program of the small fc model (conftest.py): the sync barrier protocol, retries, Complete,
wait(), the barrier timeout, and validation errors that leave every variable bit-identical."""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import pytest

from runtime.rpc.pserver import BarrierKind, PServerError, Status
from runtime.rpc.wire import decode_variable, encode_variable
from runtime.scope import SelectedRows
from tests.runtime.rpc.conftest import LR, PARAMS, SHAPES, inc, random_grads

SEND, FETCH = BarrierKind.SEND, BarrierKind.FETCH
BLOCKED_S = 0.3  # how long a call must stay blocked to count as "waiting"


def _sgd(before: dict[str, np.ndarray], *grads: dict[str, np.ndarray], scale: float = 1.0) -> dict[str, np.ndarray]:
    out = {}
    for p in PARAMS:
        total = np.sum([g[p] for g in grads], axis=0, dtype=np.float32)
        out[p] = before[p] - np.float32(LR) * (total * np.float32(scale))
    return out


def _assert_params(h: Any, want: dict[str, np.ndarray]) -> None:
    got = h.params()
    for p in PARAMS:
        np.testing.assert_allclose(got[p], want[p], rtol=1e-6, atol=1e-6, err_msg=p)


def _assert_unchanged(h: Any, before: dict[str, np.ndarray]) -> None:
    got = h.params()
    for p in PARAMS:
        assert got[p].tobytes() == before[p].tobytes(), f"{p} changed"


def _step(h: Any, spawn: Callable[..., Any], step: int, grads: list[dict[str, np.ndarray]], seq: int) -> None:
    """One whole sync step: every trainer sends ``grads[t]`` and both barriers."""
    ps = h.pserver
    for t, g in enumerate(grads):
        h.send_grads(g, trainer_id=t, step=step, seq=seq)
    waiting = [spawn(lambda t=t: ps.barrier(t, step, SEND, inc(t))) for t in range(1, len(grads))]
    ps.barrier(0, step, SEND, inc(0))
    for w in waiting:
        w.join()
    for t in range(len(grads)):
        ps.barrier(t, step, FETCH, inc(t))


def _get(h: Any, name: str, trainer_id: int = 0) -> np.ndarray:
    return np.array(decode_variable(h.pserver.get(trainer_id, name)).value)


# --- the program under test --------------------------------------------------------------------------------------
def test_the_pserver_holds_fc_b_and_a_slice_of_fc_w(make_pserver: Callable[..., Any]) -> None:
    h = make_pserver(True)
    assert {p: h.params()[p].shape for p in PARAMS} == SHAPES
    assert h.pserver.config.trainers == 2 and h.pserver.config.sync_mode
    assert h.grad_name("fc_b", 1) == "fc_b@GRAD.trainer_1"
    assert h.pserver.health() == {"serving": True, "endpoint": h.endpoint, "pserver_id": 0, "sync_mode": True,
                                  "step": 0, "live_trainers": [0, 1], "rejected_nonfinite": 0}


# --- sync protocol -----------------------------------------------------------------------------------------------
def test_sync_optimize_runs_once_when_every_send_barrier_is_in(make_pserver: Callable[..., Any],
                                                               spawn: Callable[..., Any]) -> None:
    h = make_pserver(True)
    ps = h.pserver
    before = h.params()
    g0, g1 = random_grads(0), random_grads(1)
    h.send_grads(g0, trainer_id=0, seq=1)
    b0 = spawn(lambda: ps.barrier(0, 0, SEND, inc(0)))
    b0.thread.join(BLOCKED_S)
    assert b0.alive(), "trainer 0's SEND barrier returned before trainer 1's was in"
    assert ps.steps_run == 0
    h.send_grads(g1, trainer_id=1, seq=1)
    _assert_unchanged(h, before)  # sync sends are stored, not applied
    ps.barrier(1, 0, SEND, inc(1))
    b0.join()
    assert ps.steps_run == 1
    after = _sgd(before, g0, g1, scale=0.5)  # the pserver program averages the 2 trainers' gradients
    _assert_params(h, after)
    np.testing.assert_array_equal(_get(h, "fc_b"), h.params()["fc_b"])
    snapshot = h.params()
    ps.barrier(0, 0, SEND, inc(0))  # a retried SEND barrier of the same step
    ps.barrier(1, 0, SEND, inc(1))
    assert ps.steps_run == 1
    _assert_unchanged(h, snapshot)


def test_fetch_barriers_advance_the_step_and_gate_the_next_send_barrier(make_pserver: Callable[..., Any],
                                                                         spawn: Callable[..., Any]) -> None:
    h = make_pserver(True)
    ps = h.pserver
    g = [random_grads(0), random_grads(1)]
    h.send_grads(g[0], trainer_id=0, seq=1)
    h.send_grads(g[1], trainer_id=1, seq=1)
    b1 = spawn(lambda: ps.barrier(1, 0, SEND, inc(1)))
    ps.barrier(0, 0, SEND, inc(0))
    b1.join()
    after0 = h.params()
    ps.barrier(0, 0, FETCH, inc(0))
    assert ps.health()["step"] == 0
    # trainer 0 runs ahead: its step-1 gradients are accepted, its SEND barrier waits for trainer 1's FETCH
    g_next = random_grads(2)
    h.send_grads(g_next, trainer_id=0, step=1, seq=2)
    early = spawn(lambda: ps.barrier(0, 1, SEND, inc(0)))
    early.thread.join(BLOCKED_S)
    assert early.alive()
    ps.barrier(1, 0, FETCH, inc(1))
    assert ps.health()["step"] == 1
    early.thread.join(BLOCKED_S)
    assert early.alive(), "step 1 optimized before trainer 1's SEND barrier"
    _assert_unchanged(h, after0)
    g1_next = random_grads(3)
    h.send_grads(g1_next, trainer_id=1, step=1, seq=2)
    ps.barrier(1, 1, SEND, inc(1))
    early.join()
    assert ps.steps_run == 2
    _assert_params(h, _sgd(after0, g_next, g1_next, scale=0.5))


def test_the_next_send_barrier_counts_as_the_fetch_barrier(make_pserver: Callable[..., Any],
                                                          spawn: Callable[..., Any]) -> None:
    """RPCClient sends no FETCH barrier: a trainer's SEND barrier of step s + 1 is its FETCH barrier of s.
    The step still waits for every trainer, and step s + 1 still optimizes only once all are in."""
    h = make_pserver(True)
    ps = h.pserver
    before = h.params()
    g = [random_grads(20 + k) for k in range(4)]
    h.send_grads(g[0], trainer_id=0, seq=1)
    h.send_grads(g[1], trainer_id=1, seq=1)
    b1 = spawn(lambda: ps.barrier(1, 0, SEND, inc(1)))
    ps.barrier(0, 0, SEND, inc(0))
    b1.join()
    after0 = h.params()
    h.send_grads(g[2], trainer_id=0, step=1, seq=2)
    early = spawn(lambda: ps.barrier(0, 1, SEND, inc(0)))
    early.thread.join(BLOCKED_S)
    assert early.alive() and ps.health()["step"] == 0, "step 0 ended without trainer 1's fetch"
    _assert_unchanged(h, after0)
    h.send_grads(g[3], trainer_id=1, step=1, seq=2)
    ps.barrier(1, 1, SEND, inc(1))
    early.join()
    assert ps.health()["step"] == 1 and ps.steps_run == 2
    _assert_params(h, _sgd(_sgd(before, g[0], g[1], scale=0.5), g[2], g[3], scale=0.5))
    ps.barrier(0, 0, FETCH, inc(0))  # a late explicit FETCH barrier of step 0 (a Fluid client): a no-op
    assert ps.health()["step"] == 1 and ps.steps_run == 2


def test_fetch_barrier_without_a_send_barrier_is_a_no_op(make_pserver: Callable[..., Any],
                                                          spawn: Callable[..., Any]) -> None:
    h = make_pserver(True)
    ps = h.pserver
    before = h.snapshot()
    for t in (0, 1):
        ps.barrier(t, 0, FETCH, inc(t))  # the trainer startup program's fetch_barrier
    assert ps.health()["step"] == 0 and ps.steps_run == 0
    assert h.snapshot() == before
    params = h.params()
    g = [random_grads(4), random_grads(5)]
    _step(h, spawn, 0, g, seq=1)
    assert ps.health()["step"] == 1 and ps.steps_run == 1
    _assert_params(h, _sgd(params, *g, scale=0.5))
    ps.barrier(0, 1, FETCH, inc(0))  # step 1's FETCH barrier before its SEND barrier: ignored
    assert ps.health()["step"] == 1


def test_sync_retried_send_with_the_same_seq_is_applied_once(make_pserver: Callable[..., Any],
                                                             spawn: Callable[..., Any]) -> None:
    h = make_pserver(True)
    before = h.params()
    g = [random_grads(6), random_grads(7)]
    h.send_grads(random_grads(99), trainer_id=0, seq=1)  # later overwritten by a newer seq
    h.send_grads(g[0], trainer_id=0, seq=2)
    h.send_grads(random_grads(98), trainer_id=0, seq=2)  # a retry of seq 2 carrying other data: dropped
    h.send_grads(random_grads(97), trainer_id=0, seq=1)  # an old seq arriving late: dropped
    h.send_grads(g[1], trainer_id=1, seq=1)
    b1 = spawn(lambda: h.pserver.barrier(1, 0, SEND, inc(1)))
    h.pserver.barrier(0, 0, SEND, inc(0))
    b1.join()
    _assert_params(h, _sgd(before, *g, scale=0.5))


def test_async_retried_send_moves_the_parameter_once(make_pserver: Callable[..., Any]) -> None:
    h = make_pserver(False)
    ps = h.pserver
    before = h.params()
    g = random_grads(8)
    h.send_grads(g, trainer_id=0, seq=1)
    after = _sgd(before, g)
    _assert_params(h, after)
    steps = ps.steps_run
    h.send_grads(g, trainer_id=0, seq=1)  # a retry
    assert ps.steps_run == steps
    _assert_params(h, after)
    h.send_grads(g, trainer_id=1, seq=1)  # another trainer's seq 1 is its own
    _assert_params(h, _sgd(after, g))


def test_async_applies_each_gradient_on_arrival_without_barriers(make_pserver: Callable[..., Any]) -> None:
    h = make_pserver(False)
    ps = h.pserver
    before = h.params()
    g = random_grads(9)
    h.send(h.grad_name("fc_b", 1), g["fc_b"], trainer_id=1, seq=1)
    np.testing.assert_allclose(_get(h, "fc_b"), before["fc_b"] - np.float32(LR) * g["fc_b"], rtol=1e-6, atol=1e-6)
    assert h.params()["fc_w.block1"].tobytes() == before["fc_w.block1"].tobytes()
    ps.barrier(0, 0, SEND, inc(0))  # no-ops in async mode: they return at once
    ps.barrier(0, 7, FETCH, inc(0))
    assert ps.health()["step"] == 0


# --- Complete, wait and the timeout ------------------------------------------------------------------------------
def test_complete_lowers_the_fan_in_and_finishes_a_pending_barrier(make_pserver: Callable[..., Any],
                                                                  spawn: Callable[..., Any]) -> None:
    h = make_pserver(True)
    ps = h.pserver
    _step(h, spawn, 0, [random_grads(10), random_grads(11)], seq=1)
    after0 = h.params()
    g = random_grads(12)
    h.send_grads(g, trainer_id=0, step=1, seq=2)
    pending = spawn(lambda: ps.barrier(0, 1, SEND, inc(0)))
    pending.thread.join(BLOCKED_S)
    assert pending.alive()
    ps.complete(1, inc(1))  # trainer 1 ran out of data
    pending.join()
    # trainer 1's stale step-0 gradients are not applied again, and the step averages over the one
    # trainer that sent (uneven data: the mean over the batches present, not half of it)
    _assert_params(h, _sgd(after0, g))
    ps.barrier(0, 1, FETCH, inc(0))
    assert ps.health()["step"] == 2 and ps.health()["live_trainers"] == [0]
    g_alone = random_grads(13)
    h.send_grads(g_alone, trainer_id=0, step=2, seq=3)
    before2 = h.params()
    ps.barrier(0, 2, SEND, inc(0))  # one live trainer: nothing to wait for
    _assert_params(h, _sgd(before2, g_alone))


def test_complete_of_a_trainer_that_never_sent_finishes_the_step(make_pserver: Callable[..., Any],
                                                                spawn: Callable[..., Any]) -> None:
    h = make_pserver(True)
    ps = h.pserver
    before = h.params()
    g = random_grads(14)
    h.send_grads(g, trainer_id=0, seq=1)
    pending = spawn(lambda: ps.barrier(0, 0, SEND, inc(0)))
    pending.thread.join(BLOCKED_S)
    ps.complete(1, inc(1))  # trainer 1 had no data at all
    pending.join()
    assert ps.steps_run == 1 and ps.health()["serving"]
    _assert_params(h, _sgd(before, g))


def test_wait_returns_once_every_trainer_completed(make_pserver: Callable[..., Any],
                                                   spawn: Callable[..., Any]) -> None:
    h = make_pserver(True)
    ps = h.pserver
    waiter = spawn(ps.wait)
    waiter.thread.join(BLOCKED_S)
    assert waiter.alive()
    ps.complete(0, inc(0))
    ps.complete(0, inc(0))  # idempotent
    waiter.thread.join(BLOCKED_S)
    assert waiter.alive() and ps.health()["live_trainers"] == [1]
    ps.complete(1, inc(1))
    waiter.join(5.0)
    assert ps.health()["live_trainers"] == [] and not ps.health()["serving"]


@pytest.mark.serial  # timed: < 4 s for a 0.5 s barrier timeout
def test_a_barrier_timeout_fails_naming_the_missing_trainer_and_the_step(make_pserver: Callable[..., Any],
                                                                         spawn: Callable[..., Any]) -> None:
    h = make_pserver(True, barrier_timeout=0.5)
    ps = h.pserver
    waiter = spawn(ps.wait)
    h.send_grads(random_grads(15), trainer_id=0, seq=1)
    start = time.monotonic()
    pending = spawn(lambda: ps.barrier(0, 0, SEND, inc(0)))
    err = pending.join_error(5.0)
    assert time.monotonic() - start < 4.0
    assert isinstance(err, PServerError) and err.status is Status.ABORTED
    assert "trainer(s) [1]" in err.message and "step 0" in err.message
    failure = waiter.join_error(5.0)
    assert isinstance(failure, PServerError) and "trainer(s) [1]" in failure.message and "step 0" in failure.message
    assert not ps.health()["serving"]
    with pytest.raises(PServerError, match="trainer\\(s\\) \\[1\\]") as later:
        ps.barrier(1, 0, SEND, inc(1))  # every later call learns why
    assert later.value.status is Status.ABORTED


def test_async_silent_trainer_fails_wait_after_the_timeout(make_pserver: Callable[..., Any],
                                                          spawn: Callable[..., Any]) -> None:
    h = make_pserver(False, barrier_timeout=0.5)
    waiter = spawn(h.pserver.wait)
    failure = waiter.join_error(5.0)
    assert isinstance(failure, PServerError) and failure.status is Status.ABORTED
    assert "sent nothing for 0.5s" in failure.message


# --- validation: a rejected request changes nothing --------------------------------------------------------------
def _grad(param: str = "fc_b", dtype: str = "float32", shape: tuple[int, ...] | None = None) -> np.ndarray:
    return np.full(shape or SHAPES[param], 0.25, dtype)


Bad = Callable[[Any], Any]
BAD_REQUESTS: dict[str, tuple[Bad, Status, str, bool]] = {
    # name: (request, status, words of the message, sync only)
    "send-trainer-out-of-range": (lambda h: h.send(h.grad_name("fc_b", 0), _grad(), trainer_id=2, seq=9),
                                  Status.INVALID_ARGUMENT, "trainer_id 2 is out of range", False),
    "get-negative-trainer": (lambda h: h.pserver.get(-1, "fc_b"), Status.INVALID_ARGUMENT,
                             "trainer_id -1 is out of range", False),
    "barrier-trainer-out-of-range": (lambda h: h.pserver.barrier(2, 0, SEND, inc(2)), Status.INVALID_ARGUMENT,
                                     "trainer_id 2 is out of range", False),
    "complete-trainer-out-of-range": (lambda h: h.pserver.complete(7, inc(7)), Status.INVALID_ARGUMENT,
                                      "trainer_id 7 is out of range", False),
    "send-unknown-variable": (lambda h: h.send("fc_c@GRAD", _grad(), trainer_id=0, seq=9), Status.NOT_FOUND,
                              "'fc_c@GRAD': this pserver receives no such variable", False),
    "get-unknown-variable": (lambda h: h.pserver.get(0, "fc_c"), Status.NOT_FOUND,
                             "'fc_c': this pserver holds no such variable", False),
    "prefetch-unknown-ids": (lambda h: h.pserver.prefetch(decode_variable(encode_variable(
        "ids", np.zeros((2, 1), np.int64)))), Status.NOT_FOUND, "answers no such ids variable", False),
    "send-wrong-dtype": (lambda h: h.send(h.grad_name("fc_b", 0), _grad(dtype="float64"), trainer_id=0, seq=9),
                         Status.INVALID_ARGUMENT, "dtype float64, expected float32", False),
    "send-wrong-shape": (lambda h: h.send(h.grad_name("fc_b", 0), _grad(shape=(31,)), trainer_id=0, seq=9),
                         Status.INVALID_ARGUMENT, "shape [31], expected [30]", False),
    "send-wrong-rank": (lambda h: h.send(h.grad_name("fc_w.block1", 0), _grad(shape=(600,)), trainer_id=0, seq=9),
                        Status.INVALID_ARGUMENT, "shape [600], expected [20, 30]", False),
    "send-sparse-for-dense": (lambda h: h.send(h.grad_name("fc_b", 0), SelectedRows(
        np.array([1, 2]), np.ones((2,), np.float32), 30), trainer_id=0, seq=9), Status.INVALID_ARGUMENT,
        "got a selected_rows value, expected lod_tensor", False),
    "send-another-trainers-copy": (lambda h: h.send("fc_b@GRAD.trainer_1", _grad(), trainer_id=0, seq=9),
                                   Status.INVALID_ARGUMENT, "trainer 1's copy, but the request comes from trainer 0",
                                   True),
    "send-future-step": (lambda h: h.send(h.grad_name("fc_b", 0), _grad(), trainer_id=0, step=3, seq=9),
                         Status.FAILED_PRECONDITION, "for step 3, but the pserver is at step 0", True),
    "send-barrier-future-step": (lambda h: h.pserver.barrier(0, 5, SEND, inc(0)), Status.FAILED_PRECONDITION,
                                 "SEND barrier of step 5 from trainer 0, but the pserver is at step 0", True),
    "fetch-barrier-future-step": (lambda h: h.pserver.barrier(1, 2, FETCH, inc(1)), Status.FAILED_PRECONDITION,
                                  "FETCH barrier of step 2 from trainer 1, but the pserver is at step 0", True),
}
CASES = [(name, sync) for name, (*_, sync_only) in BAD_REQUESTS.items() for sync in (True, False)
         if sync or not sync_only]


@pytest.mark.parametrize("name,sync", CASES, ids=[f"{n}-{'sync' if s else 'async'}" for n, s in CASES])
def test_a_rejected_request_leaves_every_variable_bit_identical(name: str, sync: bool,
                                                                make_pserver: Callable[..., Any],
                                                                spawn: Callable[..., Any]) -> None:
    request, status, words, _ = BAD_REQUESTS[name]
    h = make_pserver(sync)
    before = h.params()
    g = [random_grads(20), random_grads(21)]
    if sync:  # both trainers' gradients of step 0 are pending when the bad request comes
        for t in (0, 1):
            h.send_grads(g[t], trainer_id=t, seq=1)
    snapshot = h.snapshot()
    with pytest.raises(PServerError) as info:
        request(h)
    assert info.value.status is status
    assert words in info.value.message
    assert h.snapshot() == snapshot
    assert h.pserver.health()["serving"] and h.pserver.health()["live_trainers"] == [0, 1]
    # the pserver goes on as if the request never came
    if sync:
        b1 = spawn(lambda: h.pserver.barrier(1, 0, SEND, inc(1)))
        h.pserver.barrier(0, 0, SEND, inc(0))
        b1.join()
        _assert_params(h, _sgd(before, *g, scale=0.5))
    else:
        h.send_grads(g[0], trainer_id=0, seq=1)
        _assert_params(h, _sgd(before, g[0]))


def test_a_stale_step_send_is_rejected(make_pserver: Callable[..., Any], spawn: Callable[..., Any]) -> None:
    h = make_pserver(True)
    _step(h, spawn, 0, [random_grads(22), random_grads(23)], seq=1)
    snapshot = h.snapshot()
    with pytest.raises(PServerError) as info:
        h.send(h.grad_name("fc_b", 1), _grad(), trainer_id=1, step=0, seq=5)
    assert info.value.status is Status.FAILED_PRECONDITION
    assert "for step 0, but the pserver is at step 1" in info.value.message
    assert h.snapshot() == snapshot


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_requests_after_complete_are_rejected(sync: bool, make_pserver: Callable[..., Any]) -> None:
    h = make_pserver(sync)
    h.pserver.complete(1, inc(1))
    snapshot = h.snapshot()
    with pytest.raises(PServerError) as info:
        h.send(h.grad_name("fc_b", 1), _grad(), trainer_id=1, seq=1)
    assert info.value.status is Status.FAILED_PRECONDITION
    assert "from trainer 1, which already sent Complete" in info.value.message
    assert h.snapshot() == snapshot
    if sync:
        with pytest.raises(PServerError, match="which already sent Complete") as barrier:
            h.pserver.barrier(1, 0, SEND, inc(1))
        assert barrier.value.status is Status.FAILED_PRECONDITION
    assert h.snapshot() == snapshot
    assert h.pserver.health()["live_trainers"] == [0]
