"""Collective-mode benchmark: ``python bench/collective_bench.py [--quick] [--vs-torch] [--plot FILE.png]
[--json FILE]``.

Everything is measured in one run, on this machine, over 127.0.0.1, each figure beside the baseline it is
compared with:

(a) allreduce bus bandwidth (bytes * 2(n-1)/n / time, nccl-tests' definition; for 2 ranks the bytes over
    the time) of 4 MiB and 64 MiB float32 over 2 and 4 trainer processes, through the runtime's own path
    (a ``c_allreduce_sum`` op run by ``runtime.Executor`` in a group formed by ``gen_nccl_id``), against
    (i) a bare ``jax.lax.psum`` under ``shard_map`` in the same processes, (ii) for 2 processes, raw
    loopback TCP between them (bytes one way, sockets of Python: a ring allreduce of 2 moves as many
    bytes each way as one send of the buffer, so raw TCP is its ceiling), and (iii) with ``--vs-torch``,
    ``torch.distributed.all_reduce`` over gloo in as many processes of its own. A figure is the slowest
    rank's median over the repetitions; ``--rounds`` (3) rounds run interleaved (per process count:
    Flotilla's job, then torch's), so load hits both alike, and the table reports the medians.
(b) ResNet and Transformer examples (``examples/resnet``, ``examples/transformer``): examples/s of 1, 2
    and 4 trainer processes (1: the untranspiled program; more: nccl2, each trainer on its share of every
    global batch of 32) and the scaling (n-process examples/s / 1-process examples/s). All processes share
    the machine's cores, so a scaling near 1 is the ceiling here, not n, and a 1-process run that already
    keeps the cores busy (Flotilla's XLA threads) leaves less to gain than one that does not. So each job
    also reports its CPU time per example (every process's), and the table its CPU scaling (1-process CPU
    per example / n-process): what data parallelism costs in CPU, which load does not distort. With
    ``--vs-torch``, after each
    Flotilla job the same job in torch (``bench/torch_models.py``: the same architectures, sizes, batch
    and optimizers): DDP over gloo for 2 and 4 processes, the bare model for 1.
(c) fused against unfused gradient allreduce for an MLP with 120 small gradients (60 layers of 16
    units): step time of 2 trainers with ``fuse_grad_size_in_MB=32`` (one collective) and ``0`` (120).

(d) Across hosts (``--hosts NS1,NS2``: network namespaces made by hand, each with an address; ``--netns``:
    two namespaced hosts on a bridge built here by ``tests/netns.py``, 10.213.7.1-2, run plain and then
    with their links shaped by ``--link RATE`` and ``--delay D``: ``tc netem``, or ``tbf`` for the rate
    alone where the kernel has no netem, which the output then says): trainer r on host r, endpoints on
    the hosts' addresses; (a)'s allreduce and raw TCP bandwidth and (b)'s 2-process examples/s per
    trainer, beside the loopback figures of this run. Building namespaces needs root and iproute2.

(e) ``--dgc`` (this section alone): Deep Gradient Compression (``DGCMomentumOptimizer``) against dense
    allreduce + momentum on the Transformer example (no dropout), 2 trainer processes, three variants:
    ``dense``, ``dgc`` (sparsity 0.999 from step 0) and ``dgc_ramp`` (the paper's [0.75, 0.9375, 0.984375,
    0.996, 0.999] over the first 50 steps; each stage's compiled branch sends its own k). Printed: bytes
    each trainer sends per step (dense: the float32 gradients a ring allreduce moves each way, i.e. their
    size; DGC: the k (int32 index, float32 value) pairs of each compressed parameter at the final
    sparsity, in the one allgather of the step, plus the dense allreduce of the parameters under
    ``--dgc-min-numel`` (16384) elements, which DGC leaves uncompressed as Fluid does), median step time,
    and the training loss every 25 steps over ``--dgc-steps`` (300) steps. All three start from the same
    initial parameters (one reference startup program's values, written over each variant's own, whose
    other ops would make the seeded initialisers draw differently) and see the same batches.
    Optimiser: momentum 0.9, Nesterov (``--no-dgc-nesterov``: plain), lr ``--dgc-lr`` (0.01), each
    gradient clipped to norm ``--dgc-clip`` (1.0; 0: none): ``GradientClipByNorm`` on the (mean)
    gradient of each dense-updated parameter, and on DGC's compressed ones DGC's own local clip (each
    trainer's gradient to ``clip / sqrt(2)``, the paper's; a clip op in front of a ``dgc`` op would make
    the transpiler allreduce that gradient densely). Without the clip, dense momentum SGD does not learn
    this task in 300 steps at any lr tried (0.001-1.0, momentum 0.9, plain or Nesterov, with or without a
    10x warm-up: the loss stays near chance, 0.69, or diverges from lr 0.5). Measured at the initial parameters: |gradient| / |parameter| is 0.41 for ``word_emb``
    and 0.86 for ``pos_emb`` (std 0.02, and the post-norm LayerNorm undoes their scale), 0.005-0.18 for
    the other weights: one lr fits neither, the embeddings' steps overshoot; Adam's per-parameter
    scaling hides that. Clipping bounds the embeddings' steps (Nesterov momentum 0.9, lr 0.01, one process:
    loss 0.014 over steps 275-299 with the clip at 1, 0.72 without).

Then the table a person reads: each figure of (a) and (b), Flotilla's value, torch's, their ratio and the
1-minute load average around the runs. Without torch (a bench-only extra: ``pip install -e '.[bench]'``)
or without ``--vs-torch`` the torch column holds the figures recorded here before (``RECORDED_TORCH``),
marked "NOT MEASURED IN THIS RUN". ``--plot FILE.png`` draws (b)'s examples/s against the process count
for both systems (matplotlib, also in the extra; skipped, saying so, without it).

Fair threads: each system runs with the thread rule its user gets by default. A Flotilla process alone
(1 process) sizes XLA's CPU pools to the CPUs it may run on; a Flotilla trainer of a group sizes them to
its share, those CPUs over the trainers of its host (``runtime.collective``, ``FLAGS_cpu_threads_per_trainer``
auto: 1 each for 2 trainers on 2 cores; a user gets the same from ``flotilla launch``). Each torch process
gets every CPU it may run on as intra-op threads (``torch.set_num_threads``, ``fair_threads``: torch's
own default sizes to the cores alike, 1 process or DDP) and waits passively at OpenMP barriers
(``TORCH_OMP_WAIT_POLICY``; torch's default spinning collapses on a loaded machine). Workers of both
systems start alike otherwise, with this process's environment.

Timings take the median of repeated runs after warm-up (compilation excluded). ``--quick`` runs fewer
repetitions; its figures say so and are not comparable with a full run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import plotting  # noqa: E402
from runtime.launch import free_ports  # noqa: E402
from tests.netns import LOOPBACK, Host, Hosts, NetnsError, existing_hosts  # noqa: E402

CROSS_HOST_PORT = 6170  # trainer r listens on 6170 of its host (a namespace's own port space); raw TCP on 6180

MIB = 1 << 20
SIZES_MIB = (4, 64)
#: libgomp's wait policy in the torch workers (unless the environment sets one): torch's OpenMP threads
#: spin at a barrier by default, which, on a machine whose cores are all busy (4 processes of 2 threads on
#: 2 cores, other jobs), made its 1-process ResNet step 5-25x slower than passive waiting did here (load
#: 5-6, 2 threads). Passive gives torch its best figure under load: the baseline is not handicapped.
TORCH_OMP_WAIT_POLICY = "PASSIVE"


# --- worker side -------------------------------------------------------------------------------------------


def _join(rank: int, endpoints: list[str]) -> None:
    from runtime.collective import join_group

    join_group(rank, endpoints)


def _timed(fn: Any, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _tcp_pair(rank: int, host: str, port: int, nbytes: int, reps: int) -> float:
    """Seconds to move ``nbytes`` from rank 0 (listening on ``host``) to rank 1 over TCP (median),
    measured on rank 1."""
    import numpy as np

    buf = bytearray(nbytes)
    view = memoryview(buf)
    if rank == 0:
        with socket.create_server((host, port)) as srv:
            conn, _ = srv.accept()
            with conn:
                payload = np.ones(nbytes // 4, np.float32).tobytes()
                for _ in range(reps + 2):
                    conn.sendall(payload)
                    conn.recv(1)
        return 0.0
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=30)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    times = []
    with conn:
        for i in range(reps + 2):
            t = time.perf_counter()
            got = 0
            while got < nbytes:
                got += conn.recv_into(view[got:], nbytes - got)
            times.append(time.perf_counter() - t)
            conn.sendall(b"k")
    return statistics.median(times[2:])


def _allreduce_program(numel: int, nranks: int) -> Any:
    from ir import Program, program_guard
    from ir.roles import OP_ROLE_ATTR, OpRole

    main = Program()
    with program_guard(main, Program()):
        block = main.global_block()
        block.create_var("buf", shape=(numel,), dtype="float32", persistable=True)
        block.append_op("c_allreduce_sum", {"X": ["buf"]}, {"Out": ["buf"]},
                        {"nranks": nranks, OP_ROLE_ATTR: int(OpRole.BACKWARD)})
    return main


def worker_transport(rank: int, endpoints: list[str], tcp_port: int, reps: int) -> dict[str, Any]:
    """Seconds of one allreduce of 4 and 64 MiB through the runtime and through bare psum (medians), and,
    with 2 ranks, of one TCP send of the buffer between them."""
    tcp_host = endpoints[0].rsplit(":", 1)[0]
    _join(rank, endpoints)
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import runtime
    from runtime.collective import AXIS, process_mesh

    out: dict[str, Any] = {}
    mesh = process_mesh()
    for mib in SIZES_MIB:
        numel = mib * MIB // 4
        exe, scope = runtime.Executor(), runtime.Scope()
        scope.set_var("buf", np.full(numel, 1.0 / 1024, np.float32))
        program = _allreduce_program(numel, len(endpoints))

        def through_runtime() -> None:
            exe.run(program, scope=scope)
            jax.block_until_ready(scope.find_var("buf"))

        runtime_s = _timed(through_runtime, reps)
        psum = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, AXIS), mesh=mesh.mesh, in_specs=P(), out_specs=P(),
                                     check_vma=False))
        x = mesh.to_global(np.ones(numel, np.float32), False)
        bare_s = _timed(lambda: jax.block_until_ready(psum(x)), reps)
        tcp_s = _tcp_pair(rank, tcp_host, tcp_port + (0 if mib == 4 else 1), numel * 4, reps) \
            if len(endpoints) == 2 else None
        out[f"{mib}MiB"] = {"runtime_s": runtime_s, "psum_s": bare_s, "tcp_s": tcp_s, "bytes": numel * 4}
    return out


def _torch_init(rank: int, endpoints: list[str], threads: int) -> Any:
    """torch with ``threads`` intra-op threads, in a gloo group over 127.0.0.1 when there are 2+ ranks."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if len(endpoints) > 1:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's pairs on loopback, not the host name's address
        dist.init_process_group("gloo", init_method=f"tcp://{endpoints[0]}", rank=rank, world_size=len(endpoints),
                                timeout=datetime.timedelta(seconds=120))
    return torch


def _torch_leave(n: int) -> None:
    """Leave the gloo group together: a barrier first, so rank 0 (which hosts the group's store) does not
    tear it down while another rank still uses it."""
    if n > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def worker_torch_allreduce(rank: int, endpoints: list[str], reps: int, threads: int) -> dict[str, Any]:
    """Seconds of one ``torch.distributed.all_reduce`` (gloo, sum) of 4 and 64 MiB float32 (medians)."""
    torch = _torch_init(rank, endpoints, threads)
    import torch.distributed as dist

    out: dict[str, Any] = {}
    try:
        for mib in SIZES_MIB:
            numel = mib * MIB // 4
            buf = torch.full((numel,), 1.0 / 1024, dtype=torch.float32)
            out[f"{mib}MiB"] = {"torch_s": _timed(lambda: dist.all_reduce(buf), reps), "bytes": numel * 4}
            buf.fill_(rank + 1.0)
            dist.all_reduce(buf)  # a figure of a wrong sum would be worthless: check one
            want = len(endpoints) * (len(endpoints) + 1) / 2
            if not bool((buf == want).all()):
                raise RuntimeError(f"torch gloo allreduce of {mib} MiB summed to {buf[:4].tolist()}..., not {want}")
    finally:
        _torch_leave(len(endpoints))
    return out


def _example(name: str) -> Any:
    if name == "resnet":
        from examples.resnet import train
    else:
        from examples.transformer import train
    return train


def worker_model(rank: int, endpoints: list[str], name: str, steps: int, batch: int) -> dict[str, Any]:
    """Examples/s of one trainer of ``len(endpoints)`` (1: plain single-process training)."""
    n = len(endpoints)
    if n > 1:
        _join(rank, endpoints)
    import numpy as np

    import runtime
    from transpiler import DistributeTranspiler, DistributeTranspilerConfig

    train = _example(name)
    args = train.parse_args(["--batch-size", str(batch)])
    main, startup, loss, feeds = train.build(args)
    if n > 1:
        t = DistributeTranspiler(DistributeTranspilerConfig(mode="nccl2"))
        t.transpile(rank, program=main, startup_program=startup, trainers=",".join(endpoints))
        main, startup = t.get_trainer_program(), t.get_trainer_startup_program()
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    data = list(train.batches(args, 4))
    shards = [{k: v[rank::n] for k, v in b.items()} for b in data]
    for b in shards[:2]:  # compile
        exe.run(main, feed=b, fetch_list=[loss], scope=scope)
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(steps):
        out, = exe.run(main, feed=shards[i % len(shards)], fetch_list=[loss], scope=scope)
    np.asarray(out)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"examples_per_s": steps * batch / n / elapsed, "step_s": elapsed / steps, "cores": cpu / elapsed}


def worker_torch_model(rank: int, endpoints: list[str], name: str, steps: int, batch: int,
                       threads: int) -> dict[str, Any]:
    """Examples/s of one torch trainer of ``len(endpoints)``: DDP (gloo) over the processes, or, for 1,
    the bare model (as the Flotilla side's 1 process runs the untranspiled program); timed like
    ``worker_model``: 2 warm-up steps, then ``steps`` on this rank's shares of 4 global batches."""
    n = len(endpoints)
    torch = _torch_init(rank, endpoints, threads)
    from bench import torch_models

    train = _example(name)
    args = train.parse_args(["--batch-size", str(batch)])
    torch.manual_seed(2018)
    model, opt = torch_models.build(name, args)
    model.train()
    try:
        if n > 1:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model)
        shards = [torch_models.to_tensors(name, {k: v[rank::n] for k, v in b.items()})
                  for b in train.batches(args, 4)]
        for x, y in shards[:2]:
            torch_models.train_step(model, opt, x, y)
        start, cpu = time.perf_counter(), time.process_time()
        for i in range(steps):
            loss = torch_models.train_step(model, opt, *shards[i % len(shards)])
        float(loss)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        _torch_leave(n)
    return {"examples_per_s": steps * batch / n / elapsed, "step_s": elapsed / steps, "cores": cpu / elapsed}


def worker_fusion(rank: int, endpoints: list[str], fuse_mb: float, steps: int) -> dict[str, Any]:
    _join(rank, endpoints)
    import numpy as np

    import runtime
    from ir import Program, program_guard
    from flotilla.fluid import layers, optimizer
    from ir.names import unique_name
    from transpiler import DistributeTranspiler, DistributeTranspilerConfig

    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        x = layers.data(name="x", shape=[16], dtype="float32")
        h = x
        for _ in range(60):
            h = layers.fc(input=h, size=16, act="tanh")
        loss = layers.mean(layers.square(h))
        optimizer.SGD(0.01).minimize(loss)
    t = DistributeTranspiler(DistributeTranspilerConfig(mode="nccl2", fuse_grad_size_in_MB=fuse_mb))
    t.transpile(rank, program=main, startup_program=startup, trainers=",".join(endpoints))
    main_t = t.get_trainer_program()
    collectives = sum(op.type == "c_allreduce_sum" for op in main_t.global_block().ops)
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(t.get_trainer_startup_program(), scope=scope)
    feed = {"x": np.random.default_rng(rank).normal(size=(32, 16)).astype("float32")}

    def step() -> None:
        out, = exe.run(main_t, feed=feed, fetch_list=[loss], scope=scope)
        np.asarray(out)

    return {"step_s": _timed(step, steps), "collectives": collectives}


DGC_SCHEDULE = [0.75, 0.9375, 0.984375, 0.996, 0.999]


def worker_dgc(rank: int, endpoints: list[str], variant: str, steps: int, batch: int, lr: float,
               min_numel: int = 16384, clip: float = 1.0, nesterov: bool = True) -> dict[str, Any]:
    """Step time, bytes sent per step and the loss curve of one trainer: ``variant`` is ``dense``
    (momentum + allreduce), ``dgc`` (sparsity 0.999 from step 0) or ``dgc_ramp`` (the paper's schedule
    over 50 steps). Every variant starts from the same parameters (``_initial_parameters``)."""
    n = len(endpoints)
    _join(rank, endpoints)
    import math

    import numpy as np

    import runtime
    from examples.transformer import train
    from flotilla.fluid import optimizer
    from ir.ops.dgc import dgc_k
    from transpiler import DistributeTranspiler, DistributeTranspilerConfig

    def make() -> Any:
        """Called inside build_model's program guard, after the parameters exist. The clip: each
        parameter's gradient to norm ``clip`` (GradientClipByNorm; dense: the mean gradient), except
        DGC's compressed ones, which DGC clips itself (the paper's local clipping of each trainer's
        gradient to ``clip / sqrt(N)``): a clip op between a gradient and its ``dgc`` op would make the
        transpiler allreduce that gradient densely."""
        from flotilla.fluid.clip import GradientClipByNorm, set_gradient_clip
        from ir.core import default_main_program

        params = default_main_program().all_parameters()
        dense = [p.name for p in params if variant == "dense" or math.prod(p.shape) < min_numel]
        if clip > 0 and dense:
            set_gradient_clip(GradientClipByNorm(clip), param_list=dense)
        if variant == "dense":
            return optimizer.Momentum(lr, 0.9, use_nesterov=nesterov)
        sparsity = [0.999] if variant == "dgc" else DGC_SCHEDULE
        return optimizer.DGCMomentumOptimizer(lr, 0.9, rampup_begin_step=0, rampup_step=1 if variant == "dgc" else 50,
                                              sparsity=sparsity, min_compress_numel=min_numel,
                                              use_nesterov=nesterov, local_grad_clip_norm=clip or None)

    args = train.parse_args(["--batch-size", str(batch)])
    m = _dgc_model(args, make)
    t = DistributeTranspiler(DistributeTranspilerConfig(mode="nccl2"))
    t.transpile(rank, program=m.main, startup_program=m.startup, trainers=",".join(endpoints))
    main, startup = t.get_trainer_program(), t.get_trainer_startup_program()
    block = main.global_block()
    sent = 0
    for op in block.ops:
        if op.type == "c_allreduce_sum":
            sent += sum(math.prod(block.var(g).shape) * 4 for g in op.input("X"))
        elif op.type == "dgc_allreduce":
            sent += sum(dgc_k(math.prod(block.var(g).shape), op.attr("sparsity")[-1]) * 8 for g in op.input("Grad"))
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    for name, value in _initial_parameters(args).items():
        scope.set_var(name, value)
    data_ = list(train.batches(args, steps))
    shards = [{k: v[rank::n] for k, v in b.items()} for b in data_]
    losses, times = [], []
    for i, b in enumerate(shards):
        start = time.perf_counter()
        out, = exe.run(main, feed=b, fetch_list=[m.loss], scope=scope)
        losses.append(float(np.mean(out)))
        times.append(time.perf_counter() - start)
    return {"bytes_per_step": sent, "step_s": statistics.median(times[2:]), "losses": losses}


def _dgc_model(args: argparse.Namespace, make: Any) -> Any:
    """The Transformer example without dropout, trained by ``make()``, seeded."""
    from examples.transformer import data, model as tmodel

    m = tmodel.build_model(data.VOCAB_SIZE, data.SEQ_LEN, num_classes=data.NUM_CLASSES, d_model=args.d_model,
                           num_heads=args.heads, num_layers=args.layers, d_ff=args.d_ff, dropout=0.0,
                           make_optimizer=make)
    m.main.random_seed = m.startup.random_seed = 2018
    return m


def _initial_parameters(args: argparse.Namespace) -> dict[str, Any]:
    """The parameters' initial values, the same for every variant: the startup program of one reference
    build (plain SGD, untranspiled) run once. Each variant's own startup program has other ops (its
    optimizer's accumulators, the transpiler's), so its seeded initialisers would draw other values;
    its parameters (the same names in every build) are overwritten with these."""
    import numpy as np

    import runtime
    from flotilla.fluid import optimizer

    ref = _dgc_model(args, lambda: optimizer.SGD(0.1))
    scope = runtime.Scope()
    runtime.Executor().run(ref.startup, scope=scope)
    return {p.name: np.asarray(scope.numpy(p.name)) for p in ref.main.all_parameters()}


def worker_main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    kind, rank, endpoints = spec["kind"], spec["rank"], spec["endpoints"]
    if kind == "transport":
        result = worker_transport(rank, endpoints, spec["tcp_port"], spec["reps"])
    elif kind == "dgc":
        result = worker_dgc(rank, endpoints, spec["variant"], spec["steps"], spec["batch"], spec["lr"],
                            spec["min_numel"], spec["clip"], spec["nesterov"])
    elif kind == "model":
        result = worker_model(rank, endpoints, spec["name"], spec["steps"], spec["batch"])
    elif kind == "torch_allreduce":
        result = worker_torch_allreduce(rank, endpoints, spec["reps"], spec["threads"])
    elif kind == "torch_model":
        result = worker_torch_model(rank, endpoints, spec["name"], spec["steps"], spec["batch"], spec["threads"])
    else:
        result = worker_fusion(rank, endpoints, spec["fuse_mb"], spec["steps"])
    print("RESULT " + json.dumps(result), flush=True)
    if kind.startswith("torch_"):
        # The figure is out. A torch worker once aborted in interpreter teardown after it ("terminate called
        # without an active exception": a gloo thread still joinable at exit), failing a whole run.
        sys.stderr.flush()
        os._exit(0)


# --- figures, the comparison table, the plot -----------------------------------------------------------------

#: torch's figures from the last run of ``--vs-torch`` here, printed (marked "not measured in this run") when
#: torch is not importable. Keys as ``figure_catalog``'s.
RECORDED_TORCH: dict[str, Any] = {
    "measured": "2026-11-25 on this 2-core machine by `python bench/collective_bench.py --vs-torch`, load 1.6-4.3",
    "torch": "2.13.0+cpu",
    "figures": {"allreduce_4MiB_n2": 1.25, "allreduce_64MiB_n2": 1.67, "allreduce_4MiB_n4": 0.77,
                "allreduce_64MiB_n4": 1.11, "resnet_n1": 1234.0, "resnet_n2": 652.0, "resnet_n4": 473.0,
                "transformer_n1": 1601.0, "transformer_n2": 2174.0, "transformer_n4": 1226.0,
                "resnet_cpu_scaling_n2": 0.42, "resnet_cpu_scaling_n4": 0.3, "transformer_cpu_scaling_n2": 0.84,
                "transformer_cpu_scaling_n4": 0.5},
}
MODEL_NAMES = ("resnet", "transformer")
ALLREDUCE_PROCS = (2, 4)
MODEL_PROCS = (1, 2, 4)


@dataclass(frozen=True)
class Row:
    """One figure of the comparison table: Flotilla's value beside torch's (None: no torch figure), whether
    torch's was measured in this run, and the 1-minute load average around the measurement."""

    key: str
    label: str
    unit: str
    flotilla: float
    torch: float | None
    torch_measured: bool
    load: float | None

    @property
    def ratio(self) -> float | None:
        """Flotilla / torch (higher is better for every figure of the table)."""
        if self.torch is None or not self.torch or math.isnan(self.torch) or math.isnan(self.flotilla):
            return None
        return self.flotilla / self.torch


def figure_catalog(allreduce_procs: Sequence[int] = ALLREDUCE_PROCS,
                   model_procs: Sequence[int] = MODEL_PROCS) -> list[tuple[str, str, str]]:
    """``(key, label, unit)`` of every figure of the comparison table, in table order."""
    out = [(f"allreduce_{mib}MiB_n{n}", f"allreduce {mib} MiB, {n} processes", "GB/s bus")
           for n in allreduce_procs for mib in SIZES_MIB]
    for name in MODEL_NAMES:
        out += [(f"{name}_n{n}", f"{name}, {n} process{'es' if n > 1 else ''}", "examples/s") for n in model_procs]
        out += [(f"{name}_scaling_n{n}", f"{name} scaling, {n} procs / 1", "x") for n in model_procs if n > 1]
        out += [(f"{name}_cpu_scaling_n{n}", f"{name} CPU/example, 1 proc / {n}", "x")
                for n in model_procs if n > 1]
    return out


def with_scaling(figures: dict[str, float]) -> dict[str, float]:
    """``figures`` plus ``<model>_scaling_n<n>`` = examples/s of n processes / of 1, and
    ``<model>_cpu_scaling_n<n>`` = CPU per example of 1 process / of n (1: data parallelism costs no CPU;
    load does not move it, where it moves examples/s), where both are there."""
    out = dict(figures)
    for name in MODEL_NAMES:
        one, cpu_one = figures.get(f"{name}_n1"), figures.get(f"{name}_cpu_n1")
        for key, value in figures.items():
            if key.startswith(f"{name}_n") and key != f"{name}_n1" and one:
                out[f"{name}_scaling_n{key[len(name) + 2:]}"] = value / one
            if key.startswith(f"{name}_cpu_n") and key != f"{name}_cpu_n1" and cpu_one and value:
                out[f"{name}_cpu_scaling_n{key[len(name) + 6:]}"] = cpu_one / value
    return out


def _throughput_and_cpu(runs: Sequence[dict[str, Any]], batch: int) -> tuple[float, float]:
    """A job's examples/s (its processes' sum) and CPU microseconds per example (every process's)."""
    return (sum(r["examples_per_s"] for r in runs),
            sum(r["cores"] * r["step_s"] for r in runs) / batch * 1e6)


def comparison_rows(flotilla: dict[str, float], torch: dict[str, float], torch_measured: bool,
                    loads: dict[str, float]) -> list[Row]:
    """The table's rows: every catalogued figure Flotilla has (scaling derived from the examples/s), each
    beside torch's figure of the same key when there is one. ``loads``: key -> load average (a scaling
    row takes its n-process row's)."""
    flotilla, torch = with_scaling(flotilla), with_scaling(torch)
    rows = []
    for key, label, unit in figure_catalog():
        if key not in flotilla:
            continue
        load = loads.get(key.replace("_cpu_scaling", "").replace("_scaling", ""))
        rows.append(Row(key, label, unit, flotilla[key], torch.get(key), torch_measured, load))
    return rows


def _cell(value: float | None, unit: str) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:,.0f}" if unit == "examples/s" else f"{value:.2f}"


def format_table(rows: Sequence[Row], torch_note: str) -> str:
    """The comparison table as text: figure, unit, Flotilla, torch, ratio, load; a torch figure not
    measured in this run is marked ``*`` and ``torch_note`` (which says so) follows the table."""
    header = f"   {'figure':<36} {'unit':<10} {'Flotilla':>9} {'torch':>10} {'ratio':>6} {'load':>5}"
    lines = [header, "   " + "-" * (len(header) - 3)]
    marked = False
    for r in rows:
        torch_cell = _cell(r.torch, r.unit)
        if r.torch is not None and not r.torch_measured:
            torch_cell, marked = torch_cell + "*", True
        ratio = r.ratio
        lines.append(f"   {r.label:<36} {r.unit:<10} {_cell(r.flotilla, r.unit):>9} {torch_cell:>10} "
                     f"{'-' if ratio is None else f'{ratio:.2f}':>6} "
                     f"{'-' if r.load is None else f'{r.load:.1f}':>5}")
    if marked or torch_note:
        lines.append(f"   {'* ' if marked else ''}{torch_note}")
    return "\n".join(lines)


def recorded_torch_note(reason: str) -> str:
    """The line under a table whose torch column is the recorded one."""
    return (f"torch: NOT MEASURED IN THIS RUN ({reason}); the figures recorded here before: "
            f"{RECORDED_TORCH['measured']}, torch {RECORDED_TORCH['torch']}")


def torch_version() -> str | None:
    """torch's version when it is importable (the ``bench`` extra), else None."""
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def fair_threads() -> int:
    """Intra-op threads of a torch process: the CPUs this process may run on (torch's own default sizes
    to the cores alike, alone or under DDP), which is what XLA's CPU client sizes a lone Flotilla process's
    pools to; a Flotilla trainer of a group takes its share by default (see "Fair threads" above)."""
    return len(os.sched_getaffinity(0))


def plot_scaling(path: str, rows: Sequence[Row]) -> str:
    """Write examples/s against processes, Flotilla and torch DDP, one panel per model, to ``path`` (PNG);
    returns what was done (a sentence, also when matplotlib is missing and nothing was written)."""
    try:
        plt = plotting.pyplot()
    except plotting.PlotUnavailable as e:
        return f"plot: {e}; {path} not written"

    by_key = {r.key: r for r in rows}
    fig, axes = plt.subplots(1, len(MODEL_NAMES), figsize=(5 * len(MODEL_NAMES), 4))
    for ax, name in zip(axes, MODEL_NAMES):
        points = [(n, by_key[f"{name}_n{n}"]) for n in MODEL_PROCS if f"{name}_n{n}" in by_key]
        ax.plot([n for n, _ in points], [r.flotilla for _, r in points], "o-", label="Flotilla (nccl2)")
        theirs = [(n, r.torch) for n, r in points if r.torch is not None]
        if theirs:
            measured = all(r.torch_measured for _, r in points)
            ax.plot([n for n, _ in theirs], [v for _, v in theirs], "s--" if measured else "s:",
                    label="torch DDP (gloo)" + ("" if measured else ", recorded, not this run"))
        ax.set_title(f"{name} example, global batch 32")
        ax.set_xlabel("processes (127.0.0.1, one machine)")
        ax.set_ylabel("examples/s")
        ax.set_xticks(list(MODEL_PROCS))
        ax.set_ylim(bottom=0)
        ax.legend()
    plotting.save(fig, path)
    return f"plot: {path}"


# --- driver side -------------------------------------------------------------------------------------------


def run_job(n: int, hosts: tuple[Host, ...] = (), timeout_s: float = 900, **spec: Any) -> list[dict[str, Any]]:
    """Start ``n`` worker processes with ``spec`` (rank r on ``hosts[r]``; all on 127.0.0.1 when none are
    given); return their results, rank order. A worker still running after ``timeout_s`` is killed."""
    if hosts:
        endpoints = [f"{hosts[r % len(hosts)].address}:{CROSS_HOST_PORT}" for r in range(n)]
        place = [hosts[r % len(hosts)] for r in range(n)]
    else:
        endpoints = [f"127.0.0.1:{p}" for p in free_ports(n)]
        place = [LOOPBACK] * n
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "TRAINING_ROLE"))}
    env.setdefault("FLAGS_collective_timeout_s", "120")
    if str(spec.get("kind", "")).startswith("torch_"):
        env.setdefault("OMP_WAIT_POLICY", TORCH_OMP_WAIT_POLICY)
    procs = [subprocess.Popen(place[r].command([sys.executable, __file__, "--worker",
                                                json.dumps({**spec, "rank": r, "endpoints": endpoints})]),
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(n)]
    results = []
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            if p.returncode != 0 or not lines:
                raise RuntimeError(f"a benchmark worker failed (exit {p.returncode}):\n{err[-3000:]}")
            results.append(json.loads(lines[-1][len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return results


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The bench's options (``argv``: the command line without the program name)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (figures not comparable)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    ap.add_argument("--vs-torch", action="store_true",
                    help="also measure torch.distributed gloo allreduce and torch DDP on the same models, "
                         "interleaved with Flotilla's runs (torch: pip install -e '.[bench]'; without it the "
                         "figures recorded here before are printed, marked as such)")
    ap.add_argument("--plot", default=None, metavar="FILE.png",
                    help="write examples/s against processes (1, 2, 4), Flotilla and torch DDP, to this PNG")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds of the allreduce figures, whose median is reported (3)")
    ap.add_argument("--hosts", type=lambda v: [h for h in v.split(",") if h], default=[],
                    help="NS1,NS2: also measure across these network namespaces (made by hand), section (d)")
    ap.add_argument("--netns", action="store_true",
                    help="also measure across 2 namespaced hosts built here, plain and with --link/--delay")
    ap.add_argument("--link", default="10gbit", help="the emulated link's rate (tc syntax) for --netns (10gbit)")
    ap.add_argument("--delay", default="0.1ms", help="the emulated link's one-way delay for --netns (0.1ms; '' none)")
    ap.add_argument("--skip-loopback", action="store_true",
                    help="skip (c) and the 1- and 4-process runs (the loopback figures (d) compares with stay)")
    ap.add_argument("--dgc", action="store_true", help="run section (e) alone: DGC against dense allreduce")
    ap.add_argument("--dgc-steps", type=int, default=300, help="steps of the --dgc loss curves (300)")
    ap.add_argument("--dgc-lr", type=float, default=0.01, help="learning rate of the --dgc runs (0.01)")
    ap.add_argument("--dgc-clip", type=float, default=1.0,
                    help="global-norm gradient clip of the --dgc runs (1.0; 0 disables: then dense momentum "
                         "does not learn the Transformer task)")
    ap.add_argument("--dgc-nesterov", action=argparse.BooleanOptionalAction, default=True,
                    help="Nesterov momentum in the --dgc runs (default on)")
    ap.add_argument("--dgc-min-numel", type=int, default=16384,
                    help="smallest parameter DGC compresses in the --dgc runs (16384, Fluid's; smaller ones: dense)")
    args = ap.parse_args(argv)
    if args.dgc_steps < 1 or args.dgc_lr <= 0 or args.dgc_clip < 0:
        ap.error(f"--dgc-steps must be >= 1, --dgc-lr > 0 and --dgc-clip >= 0 (0: no clip), got "
                 f"{args.dgc_steps}, {args.dgc_lr}, {args.dgc_clip}")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        ap.error(f"--plot writes a PNG: give a file name ending in .png, got {args.plot!r}")
    return args


def bus_bandwidth(nbytes: int, seconds: float, n: int) -> float:
    """GB/s of bus bandwidth of an ``n``-rank allreduce of ``nbytes`` taking ``seconds``: the bytes each
    rank sends (and receives) in a ring, ``nbytes * 2(n-1)/n``, over the time (nccl-tests' definition)."""
    return nbytes * 2 * (n - 1) / n / seconds / 1e9


class Loads:
    """The 1-minute load average sampled after each job, per figure key; ``of(key)`` is their median."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}

    def sample(self, *keys: str) -> float:
        load = os.getloadavg()[0]
        for key in keys:
            self.samples.setdefault(key, []).append(load)
        return load

    def medians(self) -> dict[str, float]:
        return {k: statistics.median(v) for k, v in self.samples.items()}


def allreduce_section(args: argparse.Namespace, reps: int, procs: Sequence[int], threads: int, use_torch: bool,
                      loads: Loads, report: dict[str, Any], note: str) -> tuple[dict[str, float], dict[str, float],
                                                                                 dict[str, Any]]:
    """Section (a): ``args.rounds`` interleaved rounds (per process count: Flotilla, then torch); returns
    (Flotilla's median bus bandwidths, torch's, the 2-process medians per size for section (d))."""
    print(f"(a) allreduce, 127.0.0.1, bus bandwidth GB/s = bytes*2(n-1)/n / time (slowest rank's median of "
          f"{reps}; medians of {args.rounds} rounds, Flotilla and torch interleaved){note}", flush=True)
    bw: dict[str, dict[str, list[float]]] = {}  # figure key -> path -> one value a round
    for rnd in range(args.rounds):
        for n in procs:
            ranks = run_job(n, kind="transport", tcp_port=free_ports(1)[0], reps=reps)
            keys = [f"allreduce_{size}_n{n}" for size in ranks[0]]
            line = f"   round {rnd + 1} n={n}: Flotilla"
            for size, key in zip(ranks[0], keys):
                f = ranks[0][size]
                for path in ("runtime", "psum"):
                    s = max(r[size][f"{path}_s"] for r in ranks)
                    bw.setdefault(key, {}).setdefault(path, []).append(bus_bandwidth(f["bytes"], s, n))
                if n == 2:
                    bw[key].setdefault("tcp", []).append(f["bytes"] / ranks[1][size]["tcp_s"] / 1e9)
                line += f" {size} {bw[key]['runtime'][-1]:.2f}"
            load = loads.sample(*keys)
            if use_torch:
                theirs = run_job(n, kind="torch_allreduce", reps=reps, threads=threads)
                line += "; torch"
                for size, key in zip(theirs[0], keys):
                    s = max(r[size]["torch_s"] for r in theirs)
                    bw[key].setdefault("torch", []).append(bus_bandwidth(theirs[0][size]["bytes"], s, n))
                    line += f" {size} {bw[key]['torch'][-1]:.2f}"
                load = loads.sample(*keys)
            print(f"{line}  (load {load:.1f})", flush=True)
    medians = {key: {path: statistics.median(vals) for path, vals in paths.items()} for key, paths in bw.items()}
    print(f"   {'procs':>5} {'size':>6} {'runtime':>8} {'bare psum':>10} {'raw TCP':>8} {'torch gloo':>11} "
          f"{'runtime/psum':>13} {'runtime/TCP':>12}")
    for key, m in medians.items():
        size, n = key.split("_")[1], key.rsplit("_n", 1)[1]
        tcp = m.get("tcp")
        per_tcp = "-" if tcp is None else f"{m['runtime'] / tcp:.2f}"
        print(f"   {n:>5} {size:>6} {m['runtime']:8.2f} {m['psum']:10.2f} {_cell(tcp, ''):>8} "
              f"{_cell(m.get('torch'), ''):>11} {m['runtime'] / m['psum']:13.2f} {per_tcp:>12}")
    report["allreduce"] = {key: {"rounds": paths, "median": medians[key]} for key, paths in bw.items()}
    for size in (f"{mib}MiB" for mib in SIZES_MIB):  # the 2-process figures under their former keys
        if f"allreduce_{size}_n2" in medians:
            report[f"allreduce_{size}"] = medians[f"allreduce_{size}_n2"]
    loop2 = {f"{mib}MiB": medians[f"allreduce_{mib}MiB_n2"] for mib in SIZES_MIB if f"allreduce_{mib}MiB_n2" in medians}
    return ({k: m["runtime"] for k, m in medians.items()},
            {k: m["torch"] for k, m in medians.items() if "torch" in m}, loop2)


def models_section(args: argparse.Namespace, steps: int, procs: Sequence[int], threads: int, use_torch: bool,
                   loads: Loads, report: dict[str, Any], note: str) -> tuple[dict[str, float], dict[str, float]]:
    """Section (b): examples/s of each example at each process count, Flotilla then torch DDP; returns
    (Flotilla's figures, torch's), keyed ``<model>_n<procs>`` (whole job: the sum over its processes)."""
    print(f"(b) examples/s, global batch 32 split over the processes, {steps} steps after 2 warm-up steps"
          + (f"; torch DDP (gloo; 1 process: the bare model), {threads} intra-op threads a process" if use_torch
             else "") + note, flush=True)
    ours: dict[str, float] = {}
    theirs: dict[str, float] = {}
    for name in MODEL_NAMES:
        for n in procs:
            key = f"{name}_n{n}"
            runs = run_job(n, kind="model", name=name, steps=steps, batch=32)
            ours[key], ours[f"{name}_cpu_n{n}"] = _throughput_and_cpu(runs, 32)
            line = f"   {name:>12} n={n}: Flotilla {ours[key]:7.0f} ({ours[f'{name}_cpu_n{n}']:4.0f} us CPU/ex)"
            load = loads.sample(key)
            if use_torch:
                runs = run_job(n, kind="torch_model", name=name, steps=steps, batch=32, threads=threads)
                theirs[key], theirs[f"{name}_cpu_n{n}"] = _throughput_and_cpu(runs, 32)
                line += f"  torch {theirs[key]:7.0f} ({theirs[f'{name}_cpu_n{n}']:4.0f} us CPU/ex)"
                load = loads.sample(key)
            print(f"{line}  (load {load:.1f})", flush=True)
        flo = with_scaling({k: v for k, v in ours.items() if k.startswith(name + "_")})
        report[f"{name}_examples_per_s"] = {
            **{f"n{n}": ours.get(f"{name}_n{n}", float("nan")) for n in procs},
            **{f"scaling_n{n}": flo.get(f"{name}_scaling_n{n}", float("nan")) for n in procs if n > 1},
            **{f"cpu_us_per_example_n{n}": ours.get(f"{name}_cpu_n{n}", float("nan")) for n in procs}}
    print("   (all processes share the machine's cores: the n-process job has the cores the 1 process had alone, "
          "so a scaling near 1 is the ceiling here, not n; CPU per example counts every process's CPU time, "
          "which load does not distort)")
    return ours, theirs


def fusion_section(steps: int, report: dict[str, Any], note: str) -> None:
    """Section (c): fused against unfused gradient allreduce, 2 processes."""
    print(f"(c) 120 small gradients (60 fc layers of 16), 2 processes, step time ms{note}", flush=True)
    fused = run_job(2, kind="fusion", fuse_mb=32.0, steps=steps)[0]
    unfused = run_job(2, kind="fusion", fuse_mb=0.0, steps=steps)[0]
    print(f"   fused ({fused['collectives']} collective): {fused['step_s'] * 1e3:.2f}   unfused "
          f"({unfused['collectives']} collectives): {unfused['step_s'] * 1e3:.2f}   unfused/fused "
          f"{unfused['step_s'] / fused['step_s']:.2f}")
    report["fusion"] = {"fused_s": fused["step_s"], "unfused_s": unfused["step_s"]}


def comparison_section(args: argparse.Namespace, version: str | None, threads: int, ours: dict[str, float],
                       theirs: dict[str, float], loads: Loads, report: dict[str, Any], note: str) -> list[Row]:
    """The table a person reads: every Flotilla figure beside torch's, measured in this run under
    ``--vs-torch`` with torch importable, else the recorded figures, marked."""
    measured = args.vs_torch and version is not None
    if measured:
        torch_figs, torch_note = theirs, ""
        title = f"torch {version}, {threads} intra-op threads a process, measured in this run"
    else:
        torch_figs = RECORDED_TORCH["figures"]
        torch_note = recorded_torch_note("torch is not installed: pip install -e '.[bench]'" if args.vs_torch
                                         else "--vs-torch not given")
        title = "torch: recorded figures, NOT measured in this run"
    rows = comparison_rows(ours, torch_figs, measured, loads.medians())
    print(f"Flotilla against PyTorch ({title}; ratio = Flotilla / torch, higher is better; load = 1-min load "
          f"average around the runs){note}")
    print(format_table(rows, torch_note))
    report["vs_torch"] = {"torch": version if measured else RECORDED_TORCH["torch"], "measured_in_this_run": measured,
                          "threads": threads, "rows": [{**dataclasses.asdict(r), "ratio": r.ratio} for r in rows]}
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        worker_main(argv[1:])
        return
    args = parse_args(argv)
    if args.dgc:
        dgc_section(args)
        return
    reps, steps = (3, 10) if args.quick else (10, 40)
    report: dict[str, Any] = {"quick": args.quick, "load_before": os.getloadavg()[0]}
    note = "  (--quick: not comparable with a full run)" if args.quick else ""
    version = torch_version() if args.vs_torch else None
    use_torch = version is not None
    threads = fair_threads()
    if args.vs_torch and not use_torch:
        print("--vs-torch: torch is not importable here (pip install -e '.[bench]'): torch's figures below are "
              "the ones recorded before, NOT measured in this run")
    loads = Loads()
    procs_ar = (2,) if args.skip_loopback else ALLREDUCE_PROCS
    procs_models = (2,) if args.skip_loopback else MODEL_PROCS
    ours, theirs, loop2 = allreduce_section(args, reps, procs_ar, threads, use_torch, loads, report, note)
    ours_m, theirs_m = models_section(args, steps, procs_models, threads, use_torch, loads, report, note)
    ours.update(ours_m)
    theirs.update(theirs_m)
    if not args.skip_loopback:
        fusion_section(steps, report, note)
    per_trainer = {name: ours[f"{name}_n2"] / 2 for name in MODEL_NAMES}
    cross_host(args, reps, steps, loop2, per_trainer, report, note)
    rows = comparison_section(args, version, threads, ours, theirs, loads, report, note)
    if args.plot:
        print(plot_scaling(args.plot, rows))
    finish(args, report)


def dgc_section(args: argparse.Namespace) -> None:
    """Section (e); see the module docstring."""
    load = os.getloadavg()[0]
    momentum = "Nesterov momentum" if args.dgc_nesterov else "momentum"
    clip = f"gradients clipped to norm {args.dgc_clip}" if args.dgc_clip > 0 else "no clip"
    print(f"(e) DGC vs dense allreduce, Transformer example, 2 processes, {args.dgc_steps} steps, "
          f"global batch 32, {momentum} 0.9, lr {args.dgc_lr}, {clip}, parameters of >= {args.dgc_min_numel} "
          f"elements compressed, the same initial parameters and batches (load {load:.1f})")
    runs = {v: run_job(2, kind="dgc", variant=v, steps=args.dgc_steps, batch=32, lr=args.dgc_lr,
                       min_numel=args.dgc_min_numel, clip=args.dgc_clip, nesterov=args.dgc_nesterov)
            for v in ("dense", "dgc", "dgc_ramp")}
    dense = runs["dense"][0]
    print(f"   {'variant':>10} {'bytes/step/trainer':>19} {'vs dense':>9} {'step ms':>8} {'vs dense':>9}")
    for v, rs in runs.items():
        r = rs[0]
        print(f"   {v:>10} {r['bytes_per_step']:19,d} {r['bytes_per_step'] / dense['bytes_per_step']:9.4f} "
              f"{r['step_s'] * 1e3:8.2f} {r['step_s'] / dense['step_s']:9.2f}")
    print("   training loss (mean of the 2 trainers' shard losses): at the step, and the mean over the 25 steps "
          "from it")
    print(f"   {'step':>5} " + " ".join(f"{v:>9} {'mean25':>7}" for v in runs))
    curves = {v: [(a + b) / 2 for a, b in zip(rs[0]["losses"], rs[1]["losses"])] for v, rs in runs.items()}
    for i in list(range(0, args.dgc_steps, 25)) + [args.dgc_steps - 1]:
        print(f"   {i:5d} " + " ".join(f"{curves[v][i]:9.4f} {statistics.mean(curves[v][i:i + 25]):7.4f}"
                                     for v in runs))
    last = max(1, args.dgc_steps // 10)
    print("   mean loss of the last 10% of steps: " +
          ", ".join(f"{v} {sum(c[-last:]) / last:.4f}" for v, c in curves.items()))
    print(f"   load after: {os.getloadavg()[0]:.1f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"load_before": load, "runs": {
            v: {"bytes_per_step": rs[0]["bytes_per_step"], "step_s": rs[0]["step_s"], "loss": curves[v]}
            for v, rs in runs.items()}}, indent=1))


def finish(args: argparse.Namespace, report: dict[str, Any]) -> None:
    report["load_after"] = os.getloadavg()[0]
    print(f"load average (1 min): {report['load_before']:.2f} before, {report['load_after']:.2f} after")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2))


def cross_host(args: argparse.Namespace, reps: int, steps: int, loop_transport: dict[str, dict[str, float]],
               loop_per_trainer: dict[str, float], report: dict[str, Any], note: str) -> None:
    """Section (d): (a)'s bandwidths and (b)'s 2-process examples/s per trainer across hosts."""
    if not (args.hosts or args.netns):
        return
    print(f"(d) across hosts, trainer r on host r: allreduce (runtime) and raw TCP GB/s, examples/s per trainer "
          f"(ratio to 127.0.0.1 above){note}")
    print(f"   {'placement':<22} {'4MiB rt':>8} {'4MiB TCP':>9} {'64MiB rt':>9} {'64MiB TCP':>10} "
          f"{'resnet':>14} {'transformer':>14} {'load':>5}")
    rows: dict[str, Any] = {}

    def measure(label: str, hosts: tuple[Host, ...]) -> None:
        t = run_job(2, hosts, kind="transport", tcp_port=CROSS_HOST_PORT + 10, reps=reps)[1]
        bw = {size: {k: f["bytes"] / f[f"{k}_s"] / 1e9 for k in ("runtime", "psum", "tcp")} for size, f in t.items()}
        models = {name: sum(r["examples_per_s"] for r in run_job(2, hosts, kind="model", name=name, steps=steps,
                                                                  batch=32)) / 2 for name in ("resnet", "transformer")}
        cells = " ".join(f"{models[n]:7.1f} ({models[n] / loop_per_trainer[n]:4.2f})" for n in models)
        load = os.getloadavg()[0]
        print(f"   {label:<22} {bw['4MiB']['runtime']:8.2f} {bw['4MiB']['tcp']:9.2f} {bw['64MiB']['runtime']:9.2f} "
              f"{bw['64MiB']['tcp']:10.2f} {cells} {load:5.2f}", flush=True)
        rows[label] = {"allreduce": bw, "per_trainer_examples_per_s": models, "load_1min": load}

    loop_bw = loop_transport
    cells = " ".join(f"{loop_per_trainer[n]:7.1f} ({1.0:4.2f})" for n in ("resnet", "transformer"))
    print(f"   {'127.0.0.1 (a, b)':<22} {loop_bw['4MiB']['runtime']:8.2f} {loop_bw['4MiB']['tcp']:9.2f} "
          f"{loop_bw['64MiB']['runtime']:9.2f} {loop_bw['64MiB']['tcp']:10.2f} {cells} {os.getloadavg()[0]:5.2f}")
    try:
        if args.hosts:
            measure("@" + ",".join(args.hosts), tuple(existing_hosts(args.hosts)))
        if args.netns:
            with Hosts.create(2) as built:
                measure("@netns", tuple(built.hosts()))
                shaped = [built.shape(i, rate=args.link, delay=args.delay or None, fallback=True) for i in range(2)]
                print(f"   links shaped: {shaped[0]} (each host's egress)")
                measure(f"@netns {args.link}", tuple(built.hosts()))
    except NetnsError as e:
        raise SystemExit(f"collective_bench: the cross-host runs could not be set up: {e} "
                         "(namespaces need root and iproute2; drop --hosts/--netns)") from e
    report["cross_host"] = rows


if __name__ == "__main__":
    main()
