"""An Executor's parameter-server session: its trainers' RPC clients and what the RPC kernels remember
between ops, one of each per trainer id.

Why a session: the kernels (``runtime.kernels.rpc``) run one op at a time but batch across ops (a run of
``recv`` ops is one fetch) and announce a trainer once per program; that memory, and the connections,
belong to the Executor that runs the program, and end when it is closed (``Executor.close`` sends every
pserver Complete through ``close``). The client only talks; the kernels' memory is ``TrainerKernelState``,
and ``split_ids`` for the id helpers, which carry no trainer id: per dense ``split_ids`` op (by its
outputs) the ids it sorted last (``runtime.kernels.rpc._SplitIds``, sorted by the session's ``IdSorter``), which ``merge_ids`` and the merge of
the table's gradient reuse only when they read those very ids.

Invariants: made empty with the Executor; no gRPC is imported until a client is first asked for, so a
local Executor never loads it.

At interpreter exit every session that made a client and was not closed (a Fluid script that never
calls ``exe.close()``) sends its Complete, saying so on stderr: without it the pservers would wait for the
trainer until their timeout and the launcher would stop the job as failed. A session registers itself
with its first client and holds on until closed, even when its Executor is dropped earlier (an executor
local to a ``main()`` that returned still owes its pservers Complete). Not after an uncaught exception:
a failed trainer must not look finished, so the pservers report it missing as before. Each Complete at
exit is bounded by ``AT_EXIT_TIMEOUT_S``, so a hung pserver cannot hold the exit.
"""
from __future__ import annotations

import atexit
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runtime.rows import IdSorter
from runtime.rpc.stream import ReceiveBuffers

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


AT_EXIT_TIMEOUT_S = 15.0

#: Sessions with clients that were not closed yet, by id (see the module docstring).
_OWING: dict[int, "RPCSession"] = {}
_hook_lock = threading.Lock()
_hook_registered = False


class RPCSession:
    """The clients and kernel states of one Executor, by trainer id, each made on first use."""

    def __init__(self) -> None:
        self._clients: dict[int, "RPCClient"] = {}
        self._states: dict[int, TrainerKernelState] = {}
        self.split_ids: dict[tuple[str, ...], Any] = {}
        self.id_sorter = IdSorter()  # its scratch is kept between steps
        self.host_buffers = ReceiveBuffers()  # aligned host memory for what host kernels hand compiled code

    @property
    def active(self) -> bool:
        """Whether this session talked to pservers (a client was made)."""
        return bool(self._clients)

    def client(self, trainer_id: int) -> "RPCClient":
        """The client of ``trainer_id`` (made on first use; ``close`` closes it)."""
        client = self._clients.get(trainer_id)
        if client is None:
            from runtime.rpc.client import RPCClient  # gRPC loads only for an executor that talks

            _owe_complete(self)
            client = self._clients[trainer_id] = RPCClient(trainer_id)
        return client

    def kernel_state(self, trainer_id: int) -> TrainerKernelState:
        state = self._states.get(trainer_id)
        if state is None:
            state = self._states[trainer_id] = TrainerKernelState()
        return state

    def close(self) -> None:
        """Close every client, in the order they were made (each tells its pservers Complete)."""
        try:
            for client in self._clients.values():
                client.close()
        finally:
            _OWING.pop(id(self), None)


def _owe_complete(session: RPCSession) -> None:
    global _hook_registered
    with _hook_lock:
        _OWING[id(session)] = session
        if not _hook_registered:
            atexit.register(_complete_at_exit)
            _hook_registered = True


def _complete_at_exit() -> None:
    """Send Complete for every session still owing it (see the module docstring)."""
    failed = getattr(sys, "last_value", None) is not None  # set by an uncaught exception
    for session in list(_OWING.values()):
        _OWING.pop(id(session), None)
        for trainer_id, client in session._clients.items():
            if client.closed:
                continue
            if failed:
                _log(f"[flotilla] trainer {trainer_id}: the script failed, so its Executor sends no Complete "
                     "at interpreter exit (the pservers report the trainer missing)")
                continue
            endpoints = client.announced_endpoints()
            done = threading.Thread(target=_close_quietly, args=(client,), daemon=True,
                                    name=f"trainer{trainer_id}-complete-at-exit")
            done.start()
            done.join(AT_EXIT_TIMEOUT_S)
            if done.is_alive():
                _log(f"[flotilla] trainer {trainer_id}: the Executor was never closed and Complete to "
                     f"{', '.join(endpoints)} did not finish within {AT_EXIT_TIMEOUT_S:g}s at interpreter exit")
            else:
                _log(f"[flotilla] trainer {trainer_id}: the Executor was never closed; sent Complete at "
                     f"interpreter exit to {', '.join(endpoints) or 'no pserver'} (call exe.close() when "
                     "training is done)")


def _close_quietly(client: "RPCClient") -> None:
    try:
        client.close(at_exit=True)
    except Exception as err:  # noqa: BLE001 - the exit goes on; the error is shown
        _log(f"[flotilla] trainer {client.trainer_id}: Complete at interpreter exit failed: {err}")


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


__all__ = ["RPCSession", "TrainerKernelState"]
