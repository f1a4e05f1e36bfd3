"""What the ResNet and Transformer examples share: their common options, and the training loop
(distribute, train ``--steps`` steps on this trainer's shard of the batch stream with progress lines,
evaluate, close).

Distributed, like every example (``flotilla.cluster``): the role comes from the environment that
``flotilla launch`` sets (``--nproc_per_node 2`` for collective training, ``--server_num/--worker_num``
for a parameter-server job); a pserver serves until every trainer has completed and returns ``{}``; each
trainer trains ``--steps`` steps on its shard of the batch stream (batch ``i`` goes to trainer
``i % trainers``), tags its lines ``trainer <id>: ``, evaluates, and closes its executor.

``argument_parser(description)`` holds the common options and ``parse_args(ap, argv, positive)`` checks
them (and the example's own ``positive`` ones) to be at least 1.

``train(args, model, batches, test_accuracy)`` needs ``args.steps``, ``args.log_every`` and
``args.batch_size`` (plus the cluster options of ``cluster.add_arguments``), a model with ``main``,
``startup``, ``loss`` and ``accuracy``, ``batches(total)`` yielding feed dicts (the same stream in every
process), and ``test_accuracy(exe, scope)``. It returns ``{"steps", "first_loss", "final_loss",
"train_accuracy", "test_accuracy", "examples_per_s"}`` (examples/s over the steps after the first, which
compiles), or ``{}`` in a pserver, which has served until every trainer completed.
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Iterator, Sequence

import runtime
from flotilla import cluster

#: The common options that must be at least 1.
_POSITIVE = ("steps", "batch_size", "test_size", "log_every")


def argument_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the options every classifier example has, and the cluster's."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--steps", type=int, default=50, help="training steps per trainer")
    ap.add_argument("--batch-size", type=int, default=32, help="examples a step, per trainer")
    ap.add_argument("--test-size", type=int, default=512, help="generated held-out examples")
    ap.add_argument("--log-every", type=int, default=5, help="steps between progress lines")
    ap.add_argument("--seed", type=int, default=0, help="seeds the data (the programs initialise alike)")
    cluster.add_arguments(ap)
    return ap


def parse_args(ap: argparse.ArgumentParser, argv: Sequence[str] | None,
               positive: Sequence[str] = ()) -> argparse.Namespace:
    """``argv`` read by ``ap``; the common counts and the example's ``positive`` ones must be >= 1."""
    args = ap.parse_args(argv)
    for name in _POSITIVE + tuple(positive):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def train(args: argparse.Namespace, model: Any, batches: Callable[[int], Iterator[dict[str, Any]]],
          test_accuracy: Callable[[runtime.Executor, runtime.Scope], float]) -> dict[str, float]:
    job = cluster.distribute_from_args(model.main, model.startup, args)
    if job.is_pserver:
        return {}
    tag = job.tag
    scope = runtime.Scope()
    exe = runtime.Executor(runtime.CPUPlace())
    exe.run(job.startup, scope=scope)

    step, examples, first_loss, loss, acc = 0, 0, float("nan"), float("nan"), float("nan")
    window_start, window_examples = time.perf_counter(), 0
    start = window_start
    total = args.steps * job.trainers
    for feed in job.shard(batches(total), total=total):
        loss_v, acc_v = exe.run(job.main, feed=feed, fetch_list=[model.loss, model.accuracy], scope=scope)
        step += 1
        batch = len(feed["label"])
        loss, acc = float(loss_v[0]), float(acc_v[0])
        if step == 1:  # the first step compiles: time the rest
            first_loss, start, window_start = loss, time.perf_counter(), time.perf_counter()
            continue
        examples += batch
        window_examples += batch
        if step % args.log_every == 0:
            now = time.perf_counter()
            print(f"{tag}step {step:5d}  loss {loss:.4f}  batch accuracy {acc:.3f}  "
                  f"{window_examples / (now - window_start):,.0f} examples/s", flush=True)
            window_start, window_examples = now, 0
    elapsed = time.perf_counter() - start
    examples_per_s = examples / elapsed if examples else float("nan")
    accuracy = test_accuracy(exe, scope)
    print(f"{tag}trained {step} steps ({step * args.batch_size} examples); after the first (compiling) step "
          f"{examples_per_s:,.1f} examples/s")
    print(f"{tag}test accuracy: {accuracy:.3f}", flush=True)
    exe.close()
    return {"steps": step, "first_loss": first_loss, "final_loss": loss, "train_accuracy": acc,
            "test_accuracy": accuracy, "examples_per_s": examples_per_s}
