"""An Executor's parameter-server session: its trainers' RPC clients and what the RPC kernels remember
between ops, one of each per trainer id.

Why a session: the kernels (``runtime.kernels.rpc``) run one op at a time but batch across ops (a run of
``recv`` ops is one fetch) and announce a trainer once per program; that memory, and the connections,
belong to the Executor that runs the program, and end when it is closed (``Executor.close`` sends every
pserver Complete through ``close``). The client only talks; the kernels' memory is ``TrainerKernelState``.

Invariants: made empty with the Executor; no gRPC is imported until a client is first asked for, so a
local Executor never loads it.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.rpc.client import RPCClient


@dataclass
class TrainerKernelState:
    """The RPC kernels' memory for one trainer of one Executor.

    ``announced_programs``: the (program id, version) pairs whose pservers this trainer announced itself
    to. ``op_runs``: per program (weakly: a dead program's ids must never match a new one's), per
    (version, block index), each network op's run of consecutive ops. ``recv_ahead``: the ids of the recv
    ops whose blocks their run's first op already fetched."""

    announced_programs: set[tuple[int, int]] = field(default_factory=set)
    op_runs: "weakref.WeakKeyDictionary[Any, dict[tuple[int, int], Any]]" = field(
        default_factory=weakref.WeakKeyDictionary)
    recv_ahead: set[int] = field(default_factory=set)


class RPCSession:
    """The clients and kernel states of one Executor, by trainer id, each made on first use."""

    def __init__(self) -> None:
        self._clients: dict[int, "RPCClient"] = {}
        self._states: dict[int, TrainerKernelState] = {}

    @property
    def active(self) -> bool:
        """Whether this session talked to pservers (a client was made)."""
        return bool(self._clients)

    def client(self, trainer_id: int) -> "RPCClient":
        """The client of ``trainer_id`` (made on first use; ``close`` closes it)."""
        client = self._clients.get(trainer_id)
        if client is None:
            from runtime.rpc.client import RPCClient  # gRPC loads only for an executor that talks

            client = self._clients[trainer_id] = RPCClient(trainer_id)
        return client

    def kernel_state(self, trainer_id: int) -> TrainerKernelState:
        state = self._states.get(trainer_id)
        if state is None:
            state = self._states[trainer_id] = TrainerKernelState()
        return state

    def close(self) -> None:
        """Close every client, in the order they were made (each tells its pservers Complete)."""
        for client in self._clients.values():
            client.close()


__all__ = ["RPCSession", "TrainerKernelState"]
