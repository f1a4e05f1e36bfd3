"""The ``recv`` kernel fetches a run of consecutive ``recv`` ops as one concurrent batch: the run's first
op asks the client for every block of the run in one ``get``, the others find theirs in the scope; the
``send`` kernel queues a run's gradients and flushes once, after the run's last op; an async trainer
block (sends, no barriers) fetches through the client's background ``pull``. Runs against a recording
client, without gRPC."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ir.core import Program
from ir.roles import OP_ROLE_ATTR, OpRole
from runtime.executor import HostContext
from runtime.kernels import rpc as rpc_kernels
from runtime.rpc.session import TrainerKernelState
from runtime.scope import Scope

EP0, EP1 = "127.0.0.1:6174", "127.0.0.1:6175"


class RecordingClient:
    """Answers ``get`` with a value per name and records each call's ``(endpoint, name)`` pairs."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[str, str]]] = []
        self.state = TrainerKernelState()  # the kernels' memory, as the executor's RPC session would hold it

    def get(self, requests: list[tuple[str, str]]) -> list[Any]:
        self.calls.append(list(requests))
        return [np.full((2,), len(name), np.float32) for _, name in requests]

    def barrier(self, endpoints: list[str], send: bool) -> None:
        self.calls.append([("barrier", ep) for ep in endpoints])

    def send(self, endpoint: str, name: str, value: Any) -> None:
        self.calls.append([("send", endpoint, name)])

    def flush(self) -> None:
        self.calls.append([("flush",)])

    def pull(self, key: Any, requests: list[tuple[str, str]], max_staleness: int, have_values: bool) -> Any:
        self.calls.append([("pull", max_staleness, have_values), *requests])
        return [np.full((2,), -len(name), np.float32) for _, name in requests]


@pytest.fixture()
def client(monkeypatch: pytest.MonkeyPatch) -> RecordingClient:
    c = RecordingClient()
    monkeypatch.setattr(rpc_kernels, "_client", lambda ctx, op: c)
    monkeypatch.setattr(rpc_kernels, "_state", lambda ctx, op: c.state)
    return c


def _program(layout: list[tuple[str, list[str], list[str]]]) -> Program:
    """One block of ``recv`` ops (out names, endpoints) and ``fetch_barrier`` ops, in ``layout`` order."""
    prog = Program()
    block = prog.global_block()
    for kind, outs, eps in layout:
        for n in outs:
            if not block.has_var(n):
                block.create_var(n, shape=(2,))
        attrs = {OP_ROLE_ATTR: int(OpRole.RPC), "trainer_id": 0}
        if kind == "recv":
            block.append_op("recv", {"X": []}, {"Out": outs}, {**attrs, "epmap": eps}, infer_shape=False)
        elif kind == "send":
            block.create_var("__sent", type="raw")
            block.append_op("send", {"X": outs}, {"Out": ["__sent"]}, {**attrs, "epmap": eps}, infer_shape=False)
        else:
            block.create_var("__ctl", type="raw")
            block.append_op("fetch_barrier", {"X": []}, {"Out": ["__ctl"]}, {**attrs, "endpoints": eps},
                            infer_shape=False)
    return prog


def _run(prog: Program, scope: Scope, skip: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    block = prog.global_block()
    for i, op in enumerate(block.ops):
        if i in skip:
            continue
        ctx = HostContext(None, scope, prog, block)  # type: ignore[arg-type]
        {"recv": rpc_kernels.recv, "fetch_barrier": rpc_kernels.fetch_barrier, "send": rpc_kernels.send}[op.type](
            ctx, op)


def test_consecutive_recvs_are_one_get(client: RecordingClient) -> None:
    prog = _program([("recv", ["w"], [EP0]), ("recv", ["b.block0", "b.block1"], [EP0, EP1]),
                     ("recv", ["v"], [EP1]), ("fetch_barrier", [], [EP0, EP1])])
    scope = Scope()
    for _ in range(2):  # a second step batches again
        _run(prog, scope)
    batch = [(EP0, "w"), (EP0, "b.block0"), (EP1, "b.block1"), (EP1, "v")]
    barrier = [("barrier", EP0), ("barrier", EP1)]
    assert client.calls == [batch, barrier, batch, barrier]
    for name in ["w", "b.block0", "b.block1", "v"]:
        np.testing.assert_array_equal(scope.find_var(name), np.full((2,), len(name), np.float32))
    assert client.state.recv_ahead == set()


def test_a_run_ends_at_another_op(client: RecordingClient) -> None:
    prog = _program([("recv", ["w"], [EP0]), ("fetch_barrier", [], [EP0]), ("recv", ["v"], [EP1]),
                     ("recv", ["u"], [EP1])])
    _run(prog, Scope())
    assert client.calls == [[(EP0, "w")], [("barrier", EP0)], [(EP1, "v"), (EP1, "u")]]


def test_a_recv_whose_run_did_not_start_fetches_its_own(client: RecordingClient) -> None:
    prog = _program([("recv", ["w"], [EP0]), ("recv", ["v"], [EP1]), ("recv", ["u"], [EP1])])
    scope = Scope()
    _run(prog, scope, skip={0})
    assert client.calls == [[(EP1, "v")], [(EP1, "u")]]
    assert scope.find_var("w") is None and scope.find_var("u") is not None


def test_a_run_of_sends_is_flushed_once_after_its_last_op(client: RecordingClient) -> None:
    prog = _program([("send", ["g0"], [EP0]), ("send", ["g1", "g2"], [EP0, EP1]), ("recv", ["w"], [EP0]),
                     ("send", ["g3"], [EP1])])
    scope = Scope()
    for n in ["g0", "g1", "g2", "g3"]:
        scope.set_var(n, np.zeros((2,), np.float32))
    _run(prog, scope)
    assert client.calls == [[("send", EP0, "g0")], [("send", EP0, "g1")], [("send", EP1, "g2")], [("flush",)],
                            [("pull", 1, False), (EP0, "w")], [("send", EP1, "g3")], [("flush",)]]
    np.testing.assert_array_equal(scope.find_var("w"), np.full((2,), -1, np.float32))


def test_a_block_with_barriers_fetches_in_the_foreground(client: RecordingClient) -> None:
    prog = _program([("send", ["g0"], [EP0]), ("recv", ["w"], [EP0]), ("fetch_barrier", [], [EP0])])
    scope = Scope()
    scope.set_var("g0", np.zeros((2,), np.float32))
    _run(prog, scope)
    assert client.calls[2] == [(EP0, "w")]  # get, not pull


def test_the_staleness_flag_accepts_zero_and_refuses_negatives(monkeypatch: pytest.MonkeyPatch,
                                                                client: RecordingClient) -> None:
    from runtime.flags import FlagError, flag

    monkeypatch.setenv("FLAGS_communicator_max_staleness", "0")
    assert flag("FLAGS_communicator_max_staleness") == 0
    prog = _program([("send", ["g0"], [EP0]), ("recv", ["w"], [EP0])])
    scope = Scope()
    scope.set_var("g0", np.zeros((2,), np.float32))
    scope.set_var("w", np.zeros((2,), np.float32))
    _run(prog, scope)
    assert client.calls[-1][0] == ("pull", 0, True)
    monkeypatch.setenv("FLAGS_communicator_max_staleness", "-1")
    with pytest.raises(FlagError, match="must be at least 0"):
        flag("FLAGS_communicator_max_staleness")
