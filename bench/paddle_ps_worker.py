"""One process of Paddle's own parameter server on the CTR reference job, for ``ps_bench.py --vs-paddle``.

Runs in an interpreter that has ``paddlepaddle`` (2.6.2 measured; a bench-only extra, never a
dependency of Flotilla: ``ps_bench.py --paddle-python PATH`` names it) and needs only numpy besides.
The job and the batches are ``bench/ctr_data.py``'s, exactly as Flotilla's worker trains them: one
``[table_rows, 16]`` table shared by the 26 slots, held by the pservers as a distributed sparse table
(``sparse_embedding``), fc 400-400-400 relu, fc 2 softmax, SGD 0.01, async (``a_sync``) or sync.

``python bench/paddle_ps_worker.py pserver|trainer --endpoints EP --trainers N [--trainer-id I] ...``
A trainer runs ``--warmup`` untimed steps, passes the start gate (``--gate``: the same files as
Flotilla's worker), times ``--steps`` steps and writes the same JSON fields ``ps_bench.py`` reads.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.ctr_data import (EMB_DIM, HIDDEN, LEARNING_RATE, NUM_DENSE, NUM_SLOTS, TABLE, Gate,  # noqa: E402
                             make_batches)


def _environ(args: argparse.Namespace) -> None:
    """Paddle's role variables (PaddleCloudRoleMaker reads them)."""
    server = args.role == "pserver"
    host, _, port = (args.endpoint or args.endpoints.split(",")[0]).rpartition(":")
    os.environ.update({
        "TRAINING_ROLE": "PSERVER" if server else "TRAINER", "PADDLE_PSERVERS_IP_PORT_LIST": args.endpoints,
        "PADDLE_TRAINERS_NUM": str(args.trainers), "PADDLE_TRAINER_ID": str(args.trainer_id),
        "POD_IP": host, "PADDLE_PORT": port})


def _build(paddle, table_rows: int):  # type: ignore[no-untyped-def]
    dense = paddle.static.data("dense_input", [None, NUM_DENSE], "float32")
    sparse = paddle.static.data("sparse_input", [None, NUM_SLOTS], "int64")
    label = paddle.static.data("label", [None, 1], "int64")
    # Paddle's distributed lookup wants [N, 1] ids: one lookup a slot, all of the one shared table (its
    # PS passes fuse them into one distributed_lookup_table op).
    attr = paddle.ParamAttr(name=TABLE, initializer=paddle.nn.initializer.Uniform(-0.05, 0.05))
    embs = [paddle.static.nn.sparse_embedding(slot, size=[table_rows, EMB_DIM], param_attr=attr)
            for slot in paddle.split(sparse, NUM_SLOTS, axis=1)]
    h = paddle.concat(embs + [dense], axis=1)
    for width in HIDDEN:
        h = paddle.static.nn.fc(h, width, activation="relu")
    predict = paddle.static.nn.fc(h, 2, activation="softmax")
    return paddle.mean(paddle.nn.functional.cross_entropy(predict, label, use_softmax=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("role", choices=("pserver", "trainer"))
    ap.add_argument("--endpoint", default="")
    ap.add_argument("--endpoints", required=True)
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--trainer-id", type=int, default=0)
    ap.add_argument("--mode", choices=("sync", "async"), default="async")
    ap.add_argument("--table-rows", type=int, default=1_000_000)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--id-dist", choices=("zipf", "uniform"), default="zipf")
    ap.add_argument("--gate", default="")
    ap.add_argument("--gate-count", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    _environ(args)

    import paddle
    import paddle.distributed.fleet as fleet

    paddle.enable_static()
    fleet.init()
    loss = _build(paddle, args.table_rows)
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = args.mode == "async"
    opt = fleet.distributed_optimizer(paddle.optimizer.SGD(LEARNING_RATE), strategy)
    opt.minimize(loss)
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return
    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(paddle.static.default_startup_program())
    fleet.init_worker()
    main_prog = paddle.static.default_main_program()
    batches = make_batches(1000 + args.trainer_id, args.warmup + args.steps, args.batch_size, args.table_rows,
                           args.id_dist)
    losses = []
    for batch in batches[:args.warmup]:
        (value,) = exe.run(main_prog, feed=batch, fetch_list=[loss])
        losses.append(float(np.asarray(value).ravel()[0]))
    gate = Gate(args.gate, args.gate_count, f"trainer{args.trainer_id}", args.timeout)
    gate.arrive()
    start, cpu_start = time.time(), time.process_time()
    for batch in batches[args.warmup:]:
        (value,) = exe.run(main_prog, feed=batch, fetch_list=[loss])
        losses.append(float(np.asarray(value).ravel()[0]))
    end_t, cpu_end = time.time(), time.process_time()
    gate.leave()
    fleet.stop_worker()
    result = {"trainer_id": args.trainer_id, "steps": args.steps, "examples": args.steps * args.batch_size,
              "start": start, "end": end_t, "examples_per_s": args.steps * args.batch_size / (end_t - start),
              "cpu_s": cpu_end - cpu_start, "losses": losses, "paddle": paddle.__version__}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
