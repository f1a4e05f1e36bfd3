"""Async mode's background pull (``RPCClient.pull``) against a real gRPC pserver in async mode: the
parameters a trainer gets back lag its own sends by at most ``FLAGS_communicator_max_staleness`` steps,
exactly none at 0; a step's sends go out as one batched request per pserver; a failed send surfaces at
a later recv rather than being lost."""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

from runtime.rpc.client import RPCClient, RPCError
from runtime.rpc.wire import decode_variable
from tests.runtime.rpc.conftest import LR, SHAPES, PSHandle

STEPS = 8


def _client(h: PSHandle, calls: list[str] | None = None) -> RPCClient:
    client = RPCClient(0, deadline=10.0)
    if calls is not None:
        original = client._call

        def recorded(endpoint: str, method: str, request: bytes, what: str) -> bytes:
            calls.append(method)
            return original(endpoint, method, request, what)

        client._call = recorded  # type: ignore[method-assign]
    return client


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_a_pull_lags_the_trainers_own_sends_by_at_most_the_staleness(
        staleness: int, make_pserver: Callable[..., PSHandle]) -> None:
    h = make_pserver(False, serve=True, announce=False)  # the client announces itself
    init = h.params()["fc_b"].copy()
    client = _client(h)
    try:
        seen = []
        for step in range(1, STEPS + 1):
            client.send(h.endpoint, h.grad_name("fc_b", 0), np.ones(SHAPES["fc_b"], np.float32))
            got = client.pull("run", [(h.endpoint, "fc_b")], staleness)
            if got is None:  # no pull had to be waited for: the caller keeps the values it got last
                assert step - staleness <= (seen[-1] if seen else 0), (step, seen)
                continue
            applied = int(round(float(init[0] - got[0][0]) / LR))  # each send takes LR off every entry
            assert step - staleness <= applied <= step, (step, applied)
            seen.append(applied)
        if staleness == 0:
            assert seen == list(range(1, STEPS + 1))
    finally:
        client.close()
    # every send was applied exactly once by the time the client completed
    np.testing.assert_allclose(h.params()["fc_b"], init - np.float32(LR) * STEPS, rtol=1e-5)


def test_a_steps_sends_are_one_request_per_pserver(make_pserver: Callable[..., PSHandle]) -> None:
    h = make_pserver(False, serve=True, announce=False)  # the client announces itself
    calls: list[str] = []
    client = _client(h, calls)
    try:
        client.announce([h.endpoint])
        calls.clear()
        for param in ("fc_b", "fc_w.block1"):
            client.send(h.endpoint, h.grad_name(param, 0), np.zeros(SHAPES[param], np.float32))
        values = client.get([(h.endpoint, "fc_b"), (h.endpoint, "fc_w.block1")])
    finally:
        client.close()
    assert calls == ["SendVariables", "GetVariables", "Complete"]
    assert [np.shape(v) for v in values] == [SHAPES["fc_b"], SHAPES["fc_w.block1"]]


def test_a_refused_send_is_reported_by_a_later_pull(make_pserver: Callable[..., PSHandle]) -> None:
    h = make_pserver(False, serve=True, announce=False)  # the client announces itself
    before = h.params()["fc_b"].tobytes()
    client = _client(h)
    try:
        client.send(h.endpoint, h.grad_name("fc_b", 0), np.full(SHAPES["fc_b"], np.nan, np.float32))
        with pytest.raises(RPCError, match="NaN or Inf"):
            for _ in range(3):  # the pull that carries the refused send raises within the staleness bound
                client.pull("run", [(h.endpoint, "fc_b")], 1)
    finally:
        client.close()
    assert decode_variable(h.pserver.get(0, "fc_b")).value.tobytes() == before
