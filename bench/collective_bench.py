"""Collective-mode benchmark: ``python bench/collective_bench.py [--quick] [--json FILE]``.

Everything is measured in one run, on this machine, over 127.0.0.1, each figure beside the baseline it is
compared with:

(a) allreduce bus bandwidth of 4 MiB and 64 MiB float32 over 2 trainer processes, through the runtime's
    own path (a ``c_allreduce_sum`` op run by ``runtime.Executor`` in a group formed by ``gen_nccl_id``),
    against (i) a bare ``jax.lax.psum`` under ``shard_map`` in the same processes and (ii) raw loopback
    TCP between the same two processes (bytes one way, sockets of Python). For 2 ranks the bus
    bandwidth equals the algorithm bandwidth (bytes / time); a ring allreduce moves as many bytes each
    way as one send of the buffer, so raw TCP is its ceiling.
(b) ResNet and Transformer examples (``examples/resnet``, ``examples/transformer``): examples/s of one
    process, and of 2 trainer processes (nccl2, each on its half of every global batch), and the
    scaling ratio (2-process job throughput / 1-process throughput). The 2 processes share the same 2
    cores as the 1 process had alone, so a ratio near 1 is the ceiling here, not 2.
(c) fused against unfused gradient allreduce for an MLP with 120 small gradients (60 layers of 16
    units): step time of 2 trainers with ``fuse_grad_size_in_MB=32`` (one collective) and ``0`` (120).

(d) Across hosts (``--hosts NS1,NS2``: network namespaces made by hand, each with an address; ``--netns``:
    two namespaced hosts on a bridge built here by ``tests/netns.py``, 10.213.7.1-2, run plain and then
    with their links shaped by ``--link RATE`` and ``--delay D``: ``tc netem``, or ``tbf`` for the rate
    alone where the kernel has no netem, which the output then says): trainer r on host r, endpoints on
    the hosts' addresses; (a)'s allreduce and raw TCP bandwidth and (b)'s 2-process examples/s per
    trainer, beside the loopback figures of this run. Building namespaces needs root and iproute2.

(e) ``--dgc`` (this section alone): Deep Gradient Compression (``DGCMomentumOptimizer``) against dense
    allreduce + momentum on the Transformer example, 2 trainer processes: bytes each trainer sends per
    step (dense: the float32 gradients a ring allreduce moves each way, i.e. their size; DGC: k (int32
    index, float32 value) pairs a parameter, k of its smallest sparsity, as the compiled step gathers
    them), median step time, and the training loss every 25 steps over ``--dgc-steps`` (300) steps on
    the same batches (momentum 0.9, lr ``--dgc-lr`` 0.05) for three variants: ``dense``, ``dgc``
    (sparsity 0.999 from step 0) and ``dgc_ramp`` (the paper's [0.75, 0.9375, 0.984375, 0.996, 0.999]
    over the first 50 steps; its compiled step always gathers the k of 0.75). The DGC runs start from
    the same parameters; the dense run from others (its startup program has other ops, so the seeded
    initialisers draw differently), which shows in the first losses.

Timings take the median of repeated runs after warm-up (compilation excluded). ``--quick`` runs fewer
repetitions; its figures say so and are not comparable with a full run.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from runtime.launch import free_ports  # noqa: E402
from tests.netns import LOOPBACK, Host, Hosts, NetnsError, existing_hosts  # noqa: E402

CROSS_HOST_PORT = 6170  # trainer r listens on 6170 of its host (a namespace's own port space); raw TCP on 6180

MIB = 1 << 20


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


def _allreduce_program(numel: int) -> Any:
    from ir import Program, program_guard
    from ir.roles import OP_ROLE_ATTR, OpRole

    main = Program()
    with program_guard(main, Program()):
        block = main.global_block()
        block.create_var("buf", shape=(numel,), dtype="float32", persistable=True)
        block.append_op("c_allreduce_sum", {"X": ["buf"]}, {"Out": ["buf"]},
                        {"nranks": 2, OP_ROLE_ATTR: int(OpRole.BACKWARD)})
    return main


def worker_transport(rank: int, endpoints: list[str], tcp_port: int, reps: int) -> dict[str, Any]:
    tcp_host = endpoints[0].rsplit(":", 1)[0]
    _join(rank, endpoints)
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import runtime
    from runtime.collective import AXIS, process_mesh

    out: dict[str, Any] = {}
    mesh = process_mesh()
    for mib in (4, 64):
        numel = mib * MIB // 4
        exe, scope = runtime.Executor(), runtime.Scope()
        scope.set_var("buf", np.full(numel, 1.0 / 1024, np.float32))
        program = _allreduce_program(numel)

        def through_runtime() -> None:
            exe.run(program, scope=scope)
            jax.block_until_ready(scope.find_var("buf"))

        runtime_s = _timed(through_runtime, reps)
        psum = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, AXIS), mesh=mesh.mesh, in_specs=P(), out_specs=P(),
                                     check_vma=False))
        x = mesh.to_global(np.ones(numel, np.float32), False)
        bare_s = _timed(lambda: jax.block_until_ready(psum(x)), reps)
        tcp_s = _tcp_pair(rank, tcp_host, tcp_port + (0 if mib == 4 else 1), numel * 4, reps)
        out[f"{mib}MiB"] = {"runtime_s": runtime_s, "psum_s": bare_s, "tcp_s": tcp_s, "bytes": numel * 4}
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
    start = time.perf_counter()
    for i in range(steps):
        out, = exe.run(main, feed=shards[i % len(shards)], fetch_list=[loss], scope=scope)
    np.asarray(out)
    elapsed = time.perf_counter() - start
    return {"examples_per_s": steps * batch / n / elapsed, "step_s": elapsed / steps}


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


def worker_dgc(rank: int, endpoints: list[str], variant: str, steps: int, batch: int, lr: float) -> dict[str, Any]:
    """Step time, bytes sent per step and the loss curve of one trainer: ``variant`` is ``dense``
    (momentum + allreduce), ``dgc`` (sparsity 0.999 from step 0) or ``dgc_ramp`` (the paper's schedule
    over 50 steps)."""
    n = len(endpoints)
    _join(rank, endpoints)
    import math

    import numpy as np

    import runtime
    from examples.transformer import data, model as tmodel, train
    from flotilla.fluid import optimizer
    from transpiler import DistributeTranspiler, DistributeTranspilerConfig

    def make() -> Any:
        if variant == "dense":
            return optimizer.Momentum(lr, 0.9)
        sparsity = [0.999] if variant == "dgc" else DGC_SCHEDULE
        return optimizer.DGCMomentumOptimizer(lr, 0.9, rampup_begin_step=0, rampup_step=1 if variant == "dgc" else 50,
                                              sparsity=sparsity)

    args = train.parse_args(["--batch-size", str(batch)])
    m = tmodel.build_model(data.VOCAB_SIZE, data.SEQ_LEN, num_classes=data.NUM_CLASSES, d_model=args.d_model,
                           num_heads=args.heads, num_layers=args.layers, d_ff=args.d_ff, dropout=0.0,
                           make_optimizer=make)
    m.main.random_seed = m.startup.random_seed = 2018  # the same initial parameters in every job
    t = DistributeTranspiler(DistributeTranspilerConfig(mode="nccl2"))
    t.transpile(rank, program=m.main, startup_program=m.startup, trainers=",".join(endpoints))
    main, startup = t.get_trainer_program(), t.get_trainer_startup_program()
    block = main.global_block()
    sent = 0
    for op in block.ops:
        if op.type == "c_allreduce_sum":
            sent += sum(math.prod(block.var(g).shape) * 4 for g in op.input("X"))
        elif op.type == "dgc_momentum":
            numel = math.prod(block.var(op.input("Param")[0]).shape)
            sent += max(1, min(numel, int(round(numel * (1.0 - min(op.attr("sparsity"))), 6)))) * 8
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    data_ = list(train.batches(args, steps))
    shards = [{k: v[rank::n] for k, v in b.items()} for b in data_]
    losses, times = [], []
    for i, b in enumerate(shards):
        start = time.perf_counter()
        out, = exe.run(main, feed=b, fetch_list=[m.loss], scope=scope)
        losses.append(float(np.mean(out)))
        times.append(time.perf_counter() - start)
    return {"bytes_per_step": sent, "step_s": statistics.median(times[2:]), "losses": losses}


def worker_main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    kind, rank, endpoints = spec["kind"], spec["rank"], spec["endpoints"]
    if kind == "transport":
        result = worker_transport(rank, endpoints, spec["tcp_port"], spec["reps"])
    elif kind == "dgc":
        result = worker_dgc(rank, endpoints, spec["variant"], spec["steps"], spec["batch"], spec["lr"])
    elif kind == "model":
        result = worker_model(rank, endpoints, spec["name"], spec["steps"], spec["batch"])
    else:
        result = worker_fusion(rank, endpoints, spec["fuse_mb"], spec["steps"])
    print("RESULT " + json.dumps(result), flush=True)


# --- driver side -------------------------------------------------------------------------------------------


def run_job(n: int, hosts: tuple[Host, ...] = (), **spec: Any) -> list[dict[str, Any]]:
    """Start ``n`` worker processes with ``spec`` (rank r on ``hosts[r]``; all on 127.0.0.1 when none are
    given); return their results, rank order."""
    if hosts:
        endpoints = [f"{hosts[r % len(hosts)].address}:{CROSS_HOST_PORT}" for r in range(n)]
        place = [hosts[r % len(hosts)] for r in range(n)]
    else:
        endpoints = [f"127.0.0.1:{p}" for p in free_ports(n)]
        place = [LOOPBACK] * n
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "TRAINING_ROLE"))}
    env.setdefault("FLAGS_collective_timeout_s", "120")
    procs = [subprocess.Popen(place[r].command([sys.executable, __file__, "--worker",
                                                json.dumps({**spec, "rank": r, "endpoints": endpoints})]),
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(n)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=900)
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


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (figures not comparable)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    ap.add_argument("--hosts", type=lambda v: [h for h in v.split(",") if h], default=[],
                    help="NS1,NS2: also measure across these network namespaces (made by hand), section (d)")
    ap.add_argument("--netns", action="store_true",
                    help="also measure across 2 namespaced hosts built here, plain and with --link/--delay")
    ap.add_argument("--link", default="10gbit", help="the emulated link's rate (tc syntax) for --netns (10gbit)")
    ap.add_argument("--delay", default="0.1ms", help="the emulated link's one-way delay for --netns (0.1ms; '' none)")
    ap.add_argument("--skip-loopback", action="store_true",
                    help="skip (c) and (b)'s 1-process runs (the loopback figures (d) compares with stay)")
    ap.add_argument("--dgc", action="store_true", help="run section (e) alone: DGC against dense allreduce")
    ap.add_argument("--dgc-steps", type=int, default=300, help="steps of the --dgc loss curves (300)")
    ap.add_argument("--dgc-lr", type=float, default=0.05, help="learning rate of the --dgc runs (0.05)")
    args = ap.parse_args()
    if args.dgc:
        dgc_section(args)
        return
    reps, steps = (3, 10) if args.quick else (10, 40)
    report: dict[str, Any] = {"quick": args.quick, "load_before": os.getloadavg()[0]}
    note = "  (--quick: not comparable with a full run)" if args.quick else ""

    print(f"(a) allreduce over 2 processes, 127.0.0.1, bus bandwidth GB/s (median of {reps}){note}")
    t = run_job(2, kind="transport", tcp_port=free_ports(1)[0], reps=reps)[1]
    print(f"   {'size':>6} {'runtime':>8} {'bare psum':>10} {'raw TCP':>8} {'runtime/TCP':>12} {'runtime/psum':>13}")
    for size, f in t.items():
        bw = {k: f["bytes"] / f[f"{k}_s"] / 1e9 for k in ("runtime", "psum", "tcp")}
        print(f"   {size:>6} {bw['runtime']:8.2f} {bw['psum']:10.2f} {bw['tcp']:8.2f} "
              f"{bw['runtime'] / bw['tcp']:12.2f} {bw['runtime'] / bw['psum']:13.2f}")
        report[f"allreduce_{size}"] = bw
    print("   reference, not measured here: torch gloo ~1.65 GB/s bus bandwidth for 64 MiB on this machine kind")

    print(f"(b) examples/s (global batch 32 split over the trainers, {steps} steps after warm-up){note}")
    print(f"   {'model':>12} {'1 process':>10} {'2 processes':>12} {'scaling':>8}")
    per_trainer: dict[str, float] = {}
    for name in ("resnet", "transformer"):
        one = float("nan") if args.skip_loopback else \
            run_job(1, kind="model", name=name, steps=steps, batch=32)[0]["examples_per_s"]
        twos = [r["examples_per_s"] for r in run_job(2, kind="model", name=name, steps=steps, batch=32)]
        two = sum(twos)
        per_trainer[name] = two / 2
        print(f"   {name:>12} {one:10.0f} {two:12.0f} {two / one:8.2f}")
        report[f"{name}_examples_per_s"] = {"one": one, "two": two, "scaling": two / one}
    print("   (2 processes share the 2 cores that 1 process had: about 1.0 is the ceiling here)")
    if args.skip_loopback:
        cross_host(args, reps, steps, t, per_trainer, report, note)
        finish(args, report)
        return

    print(f"(c) 120 small gradients (60 fc layers of 16), 2 processes, step time ms{note}")
    fused = run_job(2, kind="fusion", fuse_mb=32.0, steps=steps)[0]
    unfused = run_job(2, kind="fusion", fuse_mb=0.0, steps=steps)[0]
    print(f"   fused ({fused['collectives']} collective): {fused['step_s'] * 1e3:.2f}   unfused "
          f"({unfused['collectives']} collectives): {unfused['step_s'] * 1e3:.2f}   unfused/fused "
          f"{unfused['step_s'] / fused['step_s']:.2f}")
    report["fusion"] = {"fused_s": fused["step_s"], "unfused_s": unfused["step_s"]}
    cross_host(args, reps, steps, t, per_trainer, report, note)
    finish(args, report)


def dgc_section(args: argparse.Namespace) -> None:
    """Section (e); see the module docstring."""
    load = os.getloadavg()[0]
    print(f"(e) DGC vs dense allreduce, Transformer example, 2 processes, {args.dgc_steps} steps, "
          f"global batch 32, lr {args.dgc_lr} (load {load:.1f})")
    runs = {v: run_job(2, kind="dgc", variant=v, steps=args.dgc_steps, batch=32, lr=args.dgc_lr)
            for v in ("dense", "dgc", "dgc_ramp")}
    dense = runs["dense"][0]
    print(f"   {'variant':>10} {'bytes/step/trainer':>19} {'vs dense':>9} {'step ms':>8} {'vs dense':>9}")
    for v, rs in runs.items():
        r = rs[0]
        print(f"   {v:>10} {r['bytes_per_step']:19,d} {r['bytes_per_step'] / dense['bytes_per_step']:9.4f} "
              f"{r['step_s'] * 1e3:8.2f} {r['step_s'] / dense['step_s']:9.2f}")
    print("   training loss (mean of the 2 trainers' shard losses), every 25 steps:")
    print(f"   {'step':>5} " + " ".join(f"{v:>9}" for v in runs))
    curves = {v: [(a + b) / 2 for a, b in zip(rs[0]["losses"], rs[1]["losses"])] for v, rs in runs.items()}
    for i in list(range(0, args.dgc_steps, 25)) + [args.dgc_steps - 1]:
        print(f"   {i:5d} " + " ".join(f"{curves[v][i]:9.4f}" for v in runs))
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


def cross_host(args: argparse.Namespace, reps: int, steps: int, loop_transport: dict[str, Any],
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

    loop_bw = {size: {k: f["bytes"] / f[f"{k}_s"] / 1e9 for k in ("runtime", "tcp")} for size, f in loop_transport.items()}
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
