"""One process of ``bench/ps_bench.py``: a raw TCP sink, a pserver, a trainer or the local baseline.

``python bench/ps_bench_worker.py ROLE [options]``; ``ps_bench.py`` starts these with ``subprocess`` and
reads what each one writes to ``--out`` (JSON). Roles:

- ``tcp-sink``: a TCP server for the raw transport baseline. It binds ``--bind`` (127.0.0.1), port 0, writes
  its port to ``--out``, serves one connection and exits when it closes. Requests are a 9-byte header
  (``b"S"`` or ``b"G"``, then a little-endian uint64 length): ``S`` is followed by that many bytes, read
  with ``recv_into`` into one reused buffer, and answered with one byte; ``G`` is answered with that
  many bytes of one reused buffer.
- ``transport-pserver``: a real pserver (transpiled program, ``listen_and_serv``, gRPC) holding one
  parameter ``[rows, 1024]`` float32 of each size in ``--sizes-mib`` (``transport_program``), sync mode,
  one trainer: a send of a gradient is stored without a barrier, a get answers at once. It exits when
  the trainer sends Complete.
- ``transport-client``: the client side of the transport section across hosts (``ps_bench.py --netns``): an
  ``RPCClient`` per data-plane mode of ``--modes`` (``auto``: the TCP plane to a pserver of another host;
  ``off``: gRPC) against the transport pserver of that mode (``--endpoints``, in the same order). Every
  repetition sends a gradient of each ``--sizes-mib`` (``send`` + ``wait_sends``) and fetches the parameter,
  each mode in turn (so load falls on them alike; with ``--tcp-sink`` the raw TCP baseline too, as mode
  ``tcp``); after two warm-up rounds, ``--reps`` timed ones. Writes the median GB/s by mode, size and
  direction, and each client's ``data_plane_state``.
- ``pserver`` / ``trainer``: the CTR reference job (``build_ctr``) transpiled for ``--endpoints`` and
  ``--trainers`` in ``--mode`` sync or async, with the table distributed. A trainer runs ``--warmup``
  untimed steps, then ``--steps`` timed ones, and writes its examples/s, the time window (``time.time``,
  so windows of several processes compare), the losses, and the bytes its gRPC calls carried per step
  (``RPCClient._call`` is wrapped in this process only: the length of every request plus its reply, by
  method, and the rows of every selected-rows gradient it sent; with the data plane, the batches it moved
  through shared memory too) next to the theoretical minimum.
- ``local``: the same model, table not distributed, trained in this one process (the baseline).

Invariants: every batch comes from ``make_batches`` seeded by the trainer id, so a run is reproducible;
labels follow a fixed random linear rule of the features, so the loss falls; nothing here waits without
a bound (the RPC deadline and the pserver timeout come from the environment ``ps_bench.py`` sets).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import ir  # noqa: E402
from bench.ctr_data import (EMB_DIM, HIDDEN, LEARNING_RATE, NUM_DENSE, NUM_SLOTS, TABLE, Gate,  # noqa: E402
                             make_batches)
from flotilla.fluid import layers, optimizer  # noqa: E402
from flotilla.fluid.param_attr import ParamAttr  # noqa: E402
from ir.core import Program  # noqa: E402
from ir.errors import FlotillaError  # noqa: E402
from flotilla.fluid.initializer import Uniform  # noqa: E402
from ir.names import unique_name  # noqa: E402
from runtime.rpc.tcp_plane import recv_exact  # noqa: E402
from transpiler import DistributeTranspiler, DistributeTranspilerConfig  # noqa: E402

ROW_WIDTH = 1024
HEADER = struct.Struct("<cQ")


class WorkerError(FlotillaError):
    """A benchmark process got arguments it cannot use."""

    code = "E790"


# --- the CTR reference job ------------------------------------------------------------------------------
@dataclass(frozen=True)
class CTRJob:
    """The built programs, the loss name and the trainable parameters other than the table."""

    main: Program
    startup: Program
    loss: str
    dense_params: dict[str, tuple[int, ...]]


def build_ctr(table_rows: int, is_distributed: bool) -> CTRJob:
    """26 int64 slots sharing ONE ``[table_rows, 16]`` sparse table, 13 dense features, concat → fc
    400-400-400 relu → fc 2 softmax, mean cross entropy, SGD 0.01."""
    main, startup = Program(), Program()
    with ir.program_guard(main, startup), unique_name.guard():
        dense = layers.data("dense_input", [NUM_DENSE], dtype="float32")
        sparse = layers.data("sparse_input", [NUM_SLOTS], dtype="int64")
        label = layers.data("label", [1], dtype="int64")
        emb = layers.embedding(sparse, size=[table_rows, EMB_DIM], is_sparse=True, is_distributed=is_distributed,
                               param_attr=ParamAttr(name=TABLE, initializer=Uniform(-0.05, 0.05)))
        h = layers.concat([layers.reshape(emb, [-1, NUM_SLOTS * EMB_DIM]), dense], axis=1)
        for width in HIDDEN:
            h = layers.fc(h, width, act="relu")
        predict = layers.fc(h, 2, act="softmax")
        loss = layers.mean(layers.cross_entropy(predict, label))
        optimizer.SGD(LEARNING_RATE).minimize(loss)
    dense_params = {v.name: tuple(v.shape) for v in main.global_block().vars.values()
                    if isinstance(v, ir.Parameter) and v.trainable and v.name != TABLE}
    return CTRJob(main, startup, loss.name, dense_params)


def transpile(program: Program, startup: Program, trainer_id: int, endpoints: str, trainers: int, sync: bool,
              slice_vars: bool = True, geo_k: int = 0, trainer_endpoints: str = "") -> DistributeTranspiler:
    """Transpile for the pservers; ``geo_k`` > 0: async Geo-SGD, dense parameters synced every ``geo_k`` steps;
    ``trainer_endpoints``: hybrid mode (dense gradients allreduced among these trainers, the table on the
    pservers)."""
    geo = {"geo_sgd_mode": True, "geo_sgd_need_push_nums": geo_k} if geo_k else {}
    hybrid = {"mode": "hybrid"} if trainer_endpoints else {}
    t = DistributeTranspiler(DistributeTranspilerConfig(slice_var_up=slice_vars, **geo, **hybrid))
    t.transpile(trainer_id, program=program, startup_program=startup, pservers=endpoints,
                trainers=trainer_endpoints or trainers, sync_mode=sync)
    return t


# --- the transport pserver ----------------------------------------------------------------------------------
def transport_names(sizes_mib: list[int]) -> dict[int, tuple[str, str, tuple[int, int]]]:
    """Per size, the (gradient, parameter, shape) the transport pserver receives and serves."""
    return {mib: (f"fc_{i}.w_0@GRAD", f"fc_{i}.w_0", (mib * (1 << 20) // (4 * ROW_WIDTH), ROW_WIDTH))
            for i, mib in enumerate(sizes_mib)}


def transport_program(sizes_mib: list[int]) -> tuple[Program, Program]:
    """One fc weight ``[size MiB / 4 KiB, 1024]`` float32 per size (no bias), named as ``transport_names``
    says; SGD with learning rate 0."""
    main, startup = Program(), Program()
    with ir.program_guard(main, startup), unique_name.guard():
        outs = []
        for i, (_, param, (rows, _)) in enumerate(transport_names(sizes_mib).values()):
            x = layers.data(f"x{i}", [rows], dtype="float32")
            outs.append(layers.mean(layers.fc(x, ROW_WIDTH, bias_attr=False)))
        optimizer.SGD(0.0).minimize(outs[0] if len(outs) == 1 else layers.sums(outs))
    params = {v.name for v in main.global_block().vars.values() if isinstance(v, ir.Parameter)}
    expected = {param for _, param, _ in transport_names(sizes_mib).values()}
    if params != expected:
        raise WorkerError(f"the transport program's parameters are {sorted(params)}, expected {sorted(expected)}")
    return main, startup


# --- roles ------------------------------------------------------------------------------------------------
def run_tcp_sink(args: argparse.Namespace) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((args.bind, 0))
    server.listen(1)
    server.settimeout(args.timeout)
    pathlib.Path(args.out).write_text(json.dumps({"port": server.getsockname()[1]}))
    conn, _ = server.accept()
    conn.settimeout(args.timeout)
    server.close()
    buf = bytearray(max(1, args.buffer_mib) << 20)
    view = memoryview(buf)
    header = bytearray(HEADER.size)
    while True:
        if not recv_exact(conn, memoryview(header)):
            break
        kind, n = HEADER.unpack(header)
        if n > len(buf):
            raise WorkerError(f"tcp-sink: a request of {n} bytes exceeds the {len(buf)}-byte buffer",
                              hint="raise --buffer-mib")
        if kind == b"S":
            recv_exact(conn, view[:n])
            conn.sendall(b"k")
        else:
            conn.sendall(view[:n])
    conn.close()


def time_transfers(ways: dict[Any, Callable[[], object]], reps: int) -> dict[Any, list[float]]:
    """Seconds of each of ``reps`` calls of every way, the ways taken in turn each round after two untimed
    rounds (the first fetch learns a value's size, the second takes the data plane)."""
    samples: dict[Any, list[float]] = {key: [] for key in ways}
    for rep in range(reps + 2):
        for key, fn in ways.items():
            start = time.perf_counter()
            fn()
            if rep > 1:
                samples[key].append(time.perf_counter() - start)
    return samples


class TcpClient:
    """The raw TCP baseline's client (of a ``tcp-sink``): ``send(n)`` sends ``n`` bytes and waits for the
    one-byte answer; ``get(n)`` asks for ``n`` bytes and receives them into the same reused buffer."""

    def __init__(self, port: int, max_bytes: int, host: str = "127.0.0.1") -> None:
        self.conn = socket.create_connection((host, port), timeout=60)
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = memoryview(bytearray(np.random.default_rng(0).bytes(max_bytes)))
        self.ack = memoryview(bytearray(1))

    def _recv_exact(self, view: memoryview) -> None:
        if not recv_exact(self.conn, view):
            raise WorkerError("the tcp sink closed the connection")

    def send(self, n: int) -> None:
        self.conn.sendall(HEADER.pack(b"S", n))
        self.conn.sendall(self.buf[:n])
        self._recv_exact(self.ack)

    def get(self, n: int) -> None:
        self.conn.sendall(HEADER.pack(b"G", n))
        self._recv_exact(self.buf[:n])

    def close(self) -> None:
        self.conn.close()


def run_program_pserver(main: Program, startup: Program, t: DistributeTranspiler, endpoint: str) -> None:
    import runtime

    prog, pstartup = t.get_pserver_programs(endpoint)
    exe = runtime.Executor(runtime.CPUPlace())
    scope = runtime.Scope()
    exe.run(pstartup, scope=scope)
    exe.run(prog, scope=scope)


def run_transport_pserver(args: argparse.Namespace) -> None:
    main, startup = transport_program(args.sizes_mib)
    t = transpile(main, startup, 0, args.endpoint, 1, True, slice_vars=False)
    run_program_pserver(main, startup, t, args.endpoint)


def run_transport_client(args: argparse.Namespace) -> None:
    import statistics

    from runtime.rpc.client import RPCClient

    modes, endpoints = args.modes.split(","), args.endpoints.split(",")
    if len(modes) != len(endpoints):
        raise WorkerError(f"transport-client: {len(modes)} modes for {len(endpoints)} endpoints")
    clients = {mode: (RPCClient(0, deadline=args.timeout, data_plane=mode), ep) for mode, ep in zip(modes, endpoints)}
    rates: dict[str, dict[int, dict[str, float]]] = {mode: {} for mode in modes}
    raw = None
    if args.tcp_sink:
        host, port = args.tcp_sink.rsplit(":", 1)
        raw = TcpClient(int(port), max(args.sizes_mib) << 20, host)
        rates["tcp"] = {}
    try:
        for client, ep in clients.values():
            client.wait_ready([ep])
        rng = np.random.default_rng(0)
        for mib, (grad, param, shape) in transport_names(args.sizes_mib).items():
            value = rng.random(shape, dtype=np.float32)
            held: dict[str, list[Any]] = {mode: [] for mode in modes}
            ways: dict[tuple[str, str], Callable[[], None]] = {}
            if raw is not None:
                ways["tcp", "send"] = lambda n=value.nbytes: raw.send(n)
                ways["tcp", "get"] = lambda n=value.nbytes: raw.get(n)
            for mode, (client, ep) in clients.items():
                ways[mode, "send"] = lambda c=client, e=ep: (c.send(e, grad, value), c.wait_sends())

                def get(c: Any = client, e: str = ep, out: list[Any] = held[mode]) -> None:
                    out[:] = []  # the previous value goes first: its receive buffer is free for this fetch
                    out[:] = c.get([(e, param)])
                ways[mode, "get"] = get
            samples = time_transfers(ways, args.reps)
            for mode in modes:
                if np.asarray(held[mode][0]).nbytes != value.nbytes:
                    raise WorkerError(f"{mode}: a fetch of {param!r} returned {np.asarray(held[mode][0]).nbytes} "
                                      f"bytes, expected {value.nbytes}")
            for (mode, direction), times in samples.items():
                rates[mode].setdefault(mib, {})[direction] = value.nbytes / statistics.median(times) / 1e9
        state = {mode: client.data_plane_state() for mode, (client, _) in clients.items()}
    finally:
        for client, _ in clients.values():
            client.close()
        if raw is not None:
            raw.close()
    pathlib.Path(args.out).write_text(json.dumps({"rates": rates, "state": state}))


def run_pserver(args: argparse.Namespace) -> None:
    job = build_ctr(args.table_rows, is_distributed=True)
    t = transpile(job.main, job.startup, 0, args.endpoints, args.trainers, args.mode == "sync", geo_k=args.geo_k,
                  trainer_endpoints=args.trainer_endpoints)
    run_program_pserver(job.main, job.startup, t, args.endpoint)


class WireCounter:
    """Wraps ``RPCClient._call`` in this process: bytes of every request and reply by kind (``send``,
    ``get``, ``prefetch``, ``other``; batched and single-variable calls alike), and rows of the
    selected-rows gradients sent. Safe from the client's threads."""

    KINDS = {"SendVariable": "send", "SendVariables": "send", "GetVariable": "get", "GetVariables": "get",
             "PrefetchVariable": "prefetch"}

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.sparse_rows = 0
        self.sparse_bytes = 0

    def install(self) -> None:
        from runtime.rpc import client as client_mod
        from runtime.rpc import send_recv_pb2 as pb
        from runtime.rpc.wire import decode_batch, decode_variable

        original: Callable[..., bytes] = client_mod.RPCClient._call
        counter = self

        def counted(self: Any, endpoint: str, method: str, request: bytes, what: str) -> bytes:
            reply = original(self, endpoint, method, request, what)
            kind = WireCounter.KINDS.get(method, "other")
            sent = []
            if method == "SendVariable":
                sent = [(decode_variable(request).header, len(request) + len(reply))]
            elif method == "SendVariables":
                # an entry's size: its header, its raw rows and data, and their tags and lengths
                sent = [(d.header, d.header.ByteSize() + d.value.rows.nbytes + d.value.values.nbytes + 12)
                        for d in decode_batch(request) if d.header.type == pb.SELECTED_ROWS]
            with counter.lock:
                counter.bytes[kind] = counter.bytes.get(kind, 0) + len(request) + len(reply)
                counter.calls[kind] = counter.calls.get(kind, 0) + 1
                for header, size in sent:
                    if header.type == pb.SELECTED_ROWS:
                        counter.sparse_rows += int(header.dims[0])
                        counter.sparse_bytes += size
            return reply

        client_mod.RPCClient._call = counted  # type: ignore[method-assign]

        # The data planes move large batches through shared memory (runtime.rpc.shm) or, to a pserver on
        # another host, on a TCP stream (runtime.rpc.tcp_plane): counted by what they carry, so a job's bytes
        # per step compare across FLAGS_rpc_data_plane (the gRPC reference a shm call carries is small).
        def counted_send(send: Callable[..., bool]) -> Callable[..., bool]:
            def counted(self: Any, endpoint: str, messages: list[tuple[str, tuple[list[Any], int]]]) -> bool:
                done = send(self, endpoint, messages)
                if done:
                    headers = [(pb.VariableMessage.FromString(bytes(parts[0])), total)
                               for _, (parts, total) in messages]
                    with counter.lock:
                        counter.bytes["send"] = counter.bytes.get("send", 0) + sum(total for _, total in headers)
                        for header, total in headers:
                            if header.type == pb.SELECTED_ROWS:
                                counter.sparse_rows += int(header.dims[0])
                                counter.sparse_bytes += total
                return done
            return counted

        def counted_get(get: Callable[..., Any]) -> Callable[..., Any]:
            def counted(self: Any, endpoint: str, names: list[str]) -> Any:
                values = get(self, endpoint, names)
                if values is not None:
                    with counter.lock:
                        counter.bytes["get"] = counter.bytes.get("get", 0) + sum(
                            getattr(v, "nbytes", 0) + len(n) for n, v in zip(names, values))
                return values
            return counted

        def counted_prefetch(prefetch: Callable[..., Any]) -> Callable[..., Any]:
            def counted(self: Any, endpoint: str, name: str, ids: Any, *rest: Any) -> Any:
                rows = prefetch(self, endpoint, name, ids, *rest)
                if rows is not None:
                    with counter.lock:
                        counter.bytes["prefetch"] = counter.bytes.get("prefetch", 0) + getattr(ids, "nbytes", 0) + \
                            getattr(rows, "nbytes", 0)
                        counter.calls["prefetch"] = counter.calls.get("prefetch", 0) + 1
                return rows
            return counted

        for plane in ("shm", "tcp"):
            for kind, counted in (("send", counted_send), ("get", counted_get), ("prefetch", counted_prefetch)):
                method = f"_{kind}_{plane}"
                setattr(client_mod.RPCClient, method, counted(getattr(client_mod.RPCClient, method)))


def _train(args: argparse.Namespace, distributed: bool) -> dict[str, Any]:
    import runtime

    job = build_ctr(args.table_rows, is_distributed=distributed)
    trainer_id = args.trainer_id if distributed else 0
    if distributed:
        t = transpile(job.main, job.startup, trainer_id, args.endpoints, args.trainers, args.mode == "sync",
                      geo_k=args.geo_k, trainer_endpoints=args.trainer_endpoints)
        main, startup = t.get_trainer_program(), t.get_trainer_startup_program()
    else:
        main, startup = job.main, job.startup
    batches = make_batches(1000 + trainer_id, args.warmup + args.steps, args.batch_size, args.table_rows,
                           args.id_dist)
    counter = WireCounter()
    if distributed:
        counter.install()
    exe = runtime.Executor(runtime.CPUPlace())
    scope = runtime.Scope()
    exe.run(startup, scope=scope)
    losses = []
    for batch in batches[:args.warmup]:
        (loss,) = exe.run(main, feed=batch, fetch_list=[job.loss], scope=scope)
        losses.append(float(np.asarray(loss).ravel()[0]))
    counter.reset()
    gate = Gate(args.gate, args.gate_count, f"trainer{trainer_id}", args.timeout)
    gate.arrive()
    start, cpu_start, main_start = time.time(), time.process_time(), time.thread_time()
    for batch in batches[args.warmup:]:
        (loss,) = exe.run(main, feed=batch, fetch_list=[job.loss], scope=scope)
        losses.append(float(np.asarray(loss).ravel()[0]))
    end, cpu_end, main_end = time.time(), time.process_time(), time.thread_time()
    gate.leave()
    wire = {"bytes": dict(counter.bytes), "calls": dict(counter.calls), "sparse_rows": counter.sparse_rows,
            "sparse_bytes": counter.sparse_bytes}
    exe.close()
    timed = batches[args.warmup:]
    unique = [int(np.unique(b["sparse_input"]).size) for b in timed]
    dense_bytes = sum(int(np.prod(s)) * 4 for s in job.dense_params.values())
    return {"trainer_id": trainer_id, "steps": args.steps, "examples": args.steps * args.batch_size,
            "start": start, "end": end, "examples_per_s": args.steps * args.batch_size / (end - start),
            "cpu_s": cpu_end - cpu_start, "cpu_main_thread_s": main_end - main_start,
            "losses": losses, "unique_ids_per_step": float(np.mean(unique)),
            "ids_per_step": args.batch_size * NUM_SLOTS, "dense_param_bytes": dense_bytes, "wire": wire}


def run_trainer(args: argparse.Namespace) -> None:
    pathlib.Path(args.out).write_text(json.dumps(_train(args, distributed=True)))


def run_local(args: argparse.Namespace) -> None:
    pathlib.Path(args.out).write_text(json.dumps(_train(args, distributed=False)))


ROLES: dict[str, Callable[[argparse.Namespace], None]] = {
    "tcp-sink": run_tcp_sink, "transport-pserver": run_transport_pserver, "transport-client": run_transport_client,
    "pserver": run_pserver,
    "trainer": run_trainer, "local": run_local}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="One process of bench/ps_bench.py.")
    ap.add_argument("role", choices=sorted(ROLES))
    ap.add_argument("--out", default="", help="JSON result file (tcp-sink: its port)")
    ap.add_argument("--endpoint", default="", help="this pserver's endpoint")
    ap.add_argument("--endpoints", default="", help="every pserver endpoint, comma-separated")
    ap.add_argument("--modes", default="auto,off", help="transport-client: a data-plane mode per endpoint")
    ap.add_argument("--reps", type=int, default=7, help="transport-client: timed repetitions")
    ap.add_argument("--trainers", type=int, default=1)
    ap.add_argument("--trainer-id", type=int, default=0)
    ap.add_argument("--mode", choices=("sync", "async"), default="sync")
    ap.add_argument("--geo-k", type=int, default=0, help="async Geo-SGD: sync dense parameters every K steps")
    ap.add_argument("--trainer-endpoints", default="",
                    help="hybrid mode: every trainer's endpoint (the dense gradients' allreduce group)")
    ap.add_argument("--table-rows", type=int, default=1_000_000)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--id-dist", choices=("zipf", "uniform"), default="zipf")
    ap.add_argument("--sizes-mib", type=lambda s: [int(x) for x in s.split(",")], default=[4, 64])
    ap.add_argument("--buffer-mib", type=int, default=64)
    ap.add_argument("--bind", default="127.0.0.1", help="tcp-sink: the address to listen on")
    ap.add_argument("--tcp-sink", default="", help="transport-client: HOST:PORT of a tcp-sink (the raw TCP baseline)")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="tcp-sink: seconds to wait for the client; trainer: seconds to wait at the gate")
    ap.add_argument("--gate", default="", help="trainer/local: directory of the start gate (see Gate)")
    ap.add_argument("--gate-count", type=int, default=1, help="trainers that pass the gate")
    args = ap.parse_args(argv)
    if args.role in ("trainer", "local", "transport-client") and not args.out:
        raise WorkerError(f"role {args.role} needs --out", hint="ps_bench.py passes a file in its temp dir")
    ROLES[args.role](args)


if __name__ == "__main__":
    main()
