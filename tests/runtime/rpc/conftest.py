"""Shared fixtures of the parameter-server tests: a small transpiled model, ``PServer``s driven directly,
real gRPC servers on free 127.0.0.1 ports, and threads with bounded joins.

The model is ``small_fc``: x[40] → fc (fc_w[40, 30], fc_b[30]) → square error → mean, SGD with learning
rate ``LR``. It is transpiled for ``TRAINERS`` trainers and two pservers with ``min_block_size`` 100, so
fc_w is sliced into two row blocks of 20; the pserver under test is the first endpoint, which holds
``fc_b`` and ``fc_w.block1`` (the second endpoint is never contacted).

Invariants: every server a fixture starts is stopped (and its data-plane segments removed) in its
teardown; no shared-memory segment file is left in /dev/shm after the session; every PServer a fixture
builds is failed in teardown, so a barrier still blocked in a helper thread returns; every helper thread is
joined with a timeout and a test fails if one is still alive.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Iterator

import grpc
import numpy as np
import pytest

import runtime
from flotilla.fluid import layers, optimizer
from ir.core import Operator, Program, program_guard
from ir.names import unique_name
from flotilla.fluid.param_attr import ParamAttr
from runtime.kernels.rpc import max_message_bytes
from runtime.launch import free_ports
from runtime.rpc.pserver import PServer, PServerError, Status
from runtime.rpc.server import start_server
from runtime.rpc.shm import leftover_segments
from runtime.rpc.wire import decode_variable, encode_variable
from runtime.scope import Scope, SelectedRows
from transpiler import DistributeTranspiler, DistributeTranspilerConfig

LR = 0.1
TRAINERS = 2
JOIN_S = 10.0
PARAMS = ("fc_b", "fc_w.block1")
SHAPES = {"fc_b": (30,), "fc_w.block1": (20, 30)}
GRAD_OF = {"fc_b": "fc_b@GRAD", "fc_w.block1": "fc_w@GRAD.block1"}


def inc(trainer_id: int) -> int:
    """The incarnation id the fixtures announce trainer ``trainer_id`` with."""
    return 0x1000 + trainer_id


def free_port() -> int:
    """A port of 127.0.0.1 the OS says is free now."""
    return free_ports(1)[0]


def small_fc(width: int = 40, out: int = 30, lr: float = LR) -> tuple[Program, Program]:
    """x[width] → fc out (fc_w, fc_b) → square error → mean, SGD(lr): (main, startup)."""
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        x = layers.data(name="x", shape=[width], dtype="float32")
        pred = layers.fc(input=x, size=out, param_attr=ParamAttr(name="fc_w"), bias_attr=ParamAttr(name="fc_b"))
        y = layers.data(name="y", shape=[out], dtype="float32")
        optimizer.SGD(learning_rate=lr).minimize(layers.mean(layers.square_error_cost(input=pred, label=y)))
    return main, startup


def pserver_programs(sync: bool, endpoint: str, trainers: int = TRAINERS) -> tuple[Program, Program]:
    """The pserver main and startup programs of ``endpoint`` (the first of two pservers)."""
    main, startup = small_fc()
    t = DistributeTranspiler(DistributeTranspilerConfig(min_block_size=100))
    t.transpile(0, program=main, startup_program=startup, pservers=f"{endpoint},127.0.0.1:1", trainers=trainers,
                sync_mode=sync)
    return t.get_pserver_programs(endpoint)


def listen_op(program: Program) -> Operator:
    (op,) = [o for o in program.global_block().ops if o.type == "listen_and_serv"]
    return op


def host_copy(value: Any) -> Any:
    """A numpy copy of a scope value (arrays are copied: the executor donates parameter buffers)."""
    if isinstance(value, SelectedRows):
        return SelectedRows(np.array(value.rows, copy=True), np.array(value.values, copy=True), value.height)
    return np.array(value, copy=True)


@dataclass
class PSHandle:
    """A PServer over the pserver program of ``endpoint``, its scope, and (optionally) its gRPC server."""

    pserver: PServer
    program: Program
    scope: Scope
    endpoint: str
    server: grpc.Server | None = None

    @property
    def sync(self) -> bool:
        return self.pserver.config.sync_mode

    def grad_name(self, param: str, trainer_id: int) -> str:
        """The variable this pserver receives for ``param``'s gradient from ``trainer_id``."""
        base = GRAD_OF[param]
        block = self.program.global_block()
        for name in listen_op(self.program).input("X"):
            var = block.var(name)
            if name == base or (var.copy_of == base and var.trainer_id == trainer_id):
                return name
        raise KeyError(f"no received gradient of {param} for trainer {trainer_id}")

    def params(self) -> dict[str, np.ndarray]:
        return {p: np.array(self.scope.find_var(p), copy=True) for p in PARAMS}

    def snapshot(self) -> dict[str, tuple[str, tuple[int, ...], bytes, bytes, int]]:
        """Every variable of the scope as (dtype, shape, data bytes, row bytes, height): bit-exact."""
        out = {}
        for name in self.scope.local_var_names():
            value = host_copy(self.scope.find_var(name))
            if isinstance(value, SelectedRows):
                out[name] = (str(value.values.dtype), value.values.shape, value.values.tobytes(),
                             value.rows.astype("<i8").tobytes(), value.height)
            else:
                out[name] = (str(value.dtype), value.shape, value.tobytes(), b"", -1)
        return out

    def send(self, name: str, value: Any, *, trainer_id: int, step: int = 0, seq: int = 0) -> None:
        """Hand ``value`` to ``PServer.send`` exactly as the servicer would (through the wire format)."""
        self.pserver.send(decode_variable(encode_variable(name, value, trainer_id=trainer_id, step=step, seq=seq,
                                                          incarnation=inc(trainer_id))))

    def send_grads(self, grads: dict[str, np.ndarray], *, trainer_id: int, step: int = 0, seq: int = 0) -> None:
        """Send ``grads`` (by parameter) as ``trainer_id``'s gradients of ``step``."""
        for param, g in grads.items():
            self.send(self.grad_name(param, trainer_id), g, trainer_id=trainer_id, step=step, seq=seq)


def random_grads(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {p: rng.normal(size=SHAPES[p]).astype(np.float32) for p in PARAMS}


class Spawned:
    """A helper thread running ``fn``; ``join`` waits a bounded time and re-raises what ``fn`` raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None

        def target() -> None:
            try:
                self.result = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the joining test
                self.error = e

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: float = JOIN_S) -> Any:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise AssertionError(f"helper thread still running after {timeout:g}s")
        if self.error is not None:
            raise self.error
        return self.result

    def join_error(self, timeout: float = JOIN_S) -> BaseException:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise AssertionError(f"helper thread still running after {timeout:g}s")
        if self.error is None:
            raise AssertionError(f"expected the helper thread to raise; it returned {self.result!r}")
        return self.error


@dataclass
class Tracker:
    """What a test started: its PServers (failed, servers stopped) and threads (joined) at ``close``."""

    handles: list[PSHandle] = field(default_factory=list)
    threads: list[Spawned] = field(default_factory=list)

    def close(self) -> None:
        for h in self.handles:
            h.pserver.fail(PServerError(Status.ABORTED, "test teardown"))
            if h.server is not None:
                h.server.stop(grace=None).wait(5.0)
            h.pserver.close()
        stuck = []
        for s in self.threads:
            s.thread.join(JOIN_S)
            if s.thread.is_alive():
                stuck.append(s)
        if stuck:
            raise AssertionError(f"{len(stuck)} helper thread(s) still running after teardown")


NOMINAL_ENDPOINT = "127.0.0.1:6174"


@lru_cache(maxsize=None)
def _shared(sync: bool) -> tuple[Program, Program, runtime.Executor]:
    """Programs and an Executor shared by the un-served PServers of a mode, so their blocks compile once."""
    program, startup = pserver_programs(sync, NOMINAL_ENDPOINT)
    return program, startup, runtime.Executor()


def build_pserver(sync: bool, *, barrier_timeout: float = 30.0, serve: bool = False,
                  tracker: Tracker | None = None, announce: bool = True, security: Any = None,
                  checkpoint_root: str | None = None, **pserver_kw: Any) -> PSHandle:
    """A PServer on a fresh scope initialised by the pserver startup program. Without ``serve`` its
    program (endpoint ``NOMINAL_ENDPOINT``, never bound) and Executor are shared with the other PServers
    of the mode; with ``serve`` it is transpiled for a free 127.0.0.1 port and a gRPC server serves it there
    (with ``security``: token / TLS). With ``announce`` trainers 0 and 1 are announced as ``inc(t)``. With
    ``checkpoint_root`` CheckpointNotify saves checkpoint parts under it (``runtime.io.save_checkpoint_part``)."""
    if serve:
        endpoint = f"127.0.0.1:{free_port()}"
        program, startup = pserver_programs(sync, endpoint)
        exe = runtime.Executor()
    else:
        endpoint = NOMINAL_ENDPOINT
        program, startup, exe = _shared(sync)
    scope = Scope()
    exe.run(startup, scope=scope)

    def run_block(idx: int, block_scope: Scope) -> None:
        exe.run_block(program, idx, block_scope)

    def run_blocks(ids: tuple[int, ...], block_scope: Scope, **kw: Any) -> list[str]:
        return exe.run_blocks(program, ids, block_scope, **kw)

    def save(path: str) -> None:
        from runtime import io

        io.save_checkpoint_part(exe, path, program, vars=io.pserver_checkpoint_vars(program), scope=scope)

    # Driven directly, only the test talks to it; served, it trusts a restarted trainer as its server does.
    pserver_kw.setdefault("authenticated", not serve or (security is not None and security.authenticates_clients))
    pserver_kw.setdefault("run_blocks", run_blocks)
    pserver = PServer(program, scope, listen_op(program), run_block, barrier_timeout=barrier_timeout,
                      save_persistables=save, checkpoint_root=checkpoint_root, **pserver_kw)
    if announce:
        for t in range(TRAINERS):
            pserver.announce(t, inc(t))
    handle = PSHandle(pserver, program, scope, endpoint)
    if tracker is not None:
        tracker.handles.append(handle)
    if serve:
        handle.server = start_server(pserver, endpoint, max_message_bytes(program), security)
    return handle


SETTLE_S = 15.0  # how long a shared-memory file of another job may take to go at the session's end


def _held_elsewhere(path: str) -> bool:
    """Whether the segment file ``path`` (``flotilla-<pid>-...``) belongs to another process that still runs:
    one of a job the other pytest-xdist worker (or another run) has going, not one this session left."""
    pid = os.path.basename(path).split("-")[1]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return False  # gone: whatever it left is a leak
    return state not in (b"Z", b"X")  # a zombie has exited


@pytest.fixture(scope="session", autouse=True)
def no_segments_left() -> Iterator[None]:
    """Nothing of the data plane (runtime.rpc.shm) outlives the tests: every segment file that appears in
    /dev/shm during the session is gone at its end, unless a process still running holds it. Every process
    this session started is gone by then, so such a segment is another's (a job of the other xdist worker).
    A collective arena (``flotilla-allreduce-...``) names no process: one that such a job has just made
    is gone once its ranks mapped it, so what is left is given ``SETTLE_S`` to go; a leak stays."""
    before = set(leftover_segments())
    yield
    deadline = time.monotonic() + SETTLE_S
    while True:
        left = sorted(p for p in set(leftover_segments()) - before if not _held_elsewhere(p))
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"data-plane segments left in /dev/shm: {left}"


@pytest.fixture
def tracker() -> Iterator[Tracker]:
    t = Tracker()
    yield t
    t.close()


@pytest.fixture
def make_pserver(tracker: Tracker) -> Callable[..., PSHandle]:
    """``make_pserver(sync, barrier_timeout=..., serve=...)``: a PSHandle, failed and stopped at teardown."""

    def make(sync: bool, *, barrier_timeout: float = 30.0, serve: bool = False, **kw: Any) -> PSHandle:
        return build_pserver(sync, barrier_timeout=barrier_timeout, serve=serve, tracker=tracker, **kw)

    return make


@pytest.fixture
def spawn(tracker: Tracker) -> Callable[[Callable[[], Any]], Spawned]:
    """``spawn(fn)``: run ``fn`` in a daemon thread, joined (bounded) at teardown."""

    def start(fn: Callable[[], Any]) -> Spawned:
        s = Spawned(fn)
        tracker.threads.append(s)
        return s

    return start
