"""Train the CTR example: ``python examples/ctr/train.py [--data-dir D] [--generate N] [--epochs E]
[--batch-size 512] [--hash-dim 100003] [--optimizer sgd|adagrad|adam] [--lr LR] [--sync|--async]
[--no-slice] [--distributed-table [--hybrid]]``.

When ``--data-dir`` holds no ``train.txt``/``test.txt``, writes ``--generate`` synthetic training examples
(and a fifth as many test examples) there first (``examples/ctr/data.py``; written aside and moved into
place, so trainers that generate at once do not see each other's half-written files). Trains the
wide-and-deep model (``examples/ctr/model.py``) through ``runtime.Executor``, printing a progress line
every ``--log-every`` steps (step, loss, running AUC, examples/s), then runs the forward-only test
program over the test file and prints ``test AUC: 0.xxx``. The test program runs in a child scope whose
AUC statistics start at zero, so the training statistics are left as they were. ``main(argv)`` returns
the figures as a dict.

Distributed: the role comes from the environment (``flotilla.cluster``), so under
``flotilla launch --server_num 2 --worker_num 2 examples/ctr/train.py ...`` the same script is every
pserver and every trainer. A pserver serves until every trainer has completed and returns ``{}``. Each
trainer trains on its shard of the batches (batch ``i`` goes to trainer ``i % trainers``), tags its
lines ``trainer <id>: ``, and trainer 0 then evaluates (its test program is the forward part of its
transpiled program, so a ``--distributed-table`` is prefetched from the pservers) before every trainer
closes its executor. ``--async`` trains without barriers; ``--no-slice`` places each parameter whole on
one pserver; ``--distributed-table`` keeps the deep embedding table on the pservers only, and with
``--hybrid`` the trainers allreduce every other gradient among themselves (hybrid mode: the pservers hold
only that table).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import time
from typing import Sequence

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import ir  # noqa: E402
import runtime  # noqa: E402
from ir.errors import FlotillaError  # noqa: E402
from flotilla import cluster  # noqa: E402
from examples.ctr import data  # noqa: E402
from examples.ctr.model import OPTIMIZERS, CTRModel, build_model  # noqa: E402


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Train the wide-and-deep CTR model on Criteo-format data.")
    ap.add_argument("--data-dir", default="ctr_data", help="holds train.txt and test.txt (generated if absent)")
    ap.add_argument("--generate", type=int, default=100_000, help="training examples to generate when needed")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--hash-dim", type=int, default=100_003, help="hash buckets of the embedding tables")
    ap.add_argument("--embedding-dim", type=int, default=16)
    ap.add_argument("--hidden", type=int, nargs="+", default=[400, 400, 400], help="deep fc widths")
    ap.add_argument("--optimizer", choices=OPTIMIZERS, default="adagrad")
    ap.add_argument("--lr", type=float, default=None, help="learning rate (default: per optimizer)")
    ap.add_argument("--log-every", type=int, default=20, help="steps between progress lines")
    ap.add_argument("--seed", type=int, default=0, help="data and initialisation seed")
    ap.add_argument("--distributed-table", action="store_true",
                    help="keep the deep embedding table on the pservers (a distributed lookup table)")
    cluster.add_arguments(ap)
    return ap.parse_args(argv)


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The exact ROC AUC of ``scores`` for binary ``labels`` (ties count one half)."""
    scores, labels = np.asarray(scores, np.float64).ravel(), np.asarray(labels).ravel().astype(bool)
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores), np.float64)
    sorted_scores = scores[order]
    # Average ranks over ties.
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)
    pos = labels.sum()
    neg = len(labels) - pos
    if pos == 0 or neg == 0:
        return float("nan")
    return float((ranks[labels].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def evaluate(exe: runtime.Executor, model: CTRModel, scope: runtime.Scope, arrays: dict[str, np.ndarray],
             batch_size: int, program: ir.Program | None = None) -> tuple[float, float]:
    """(test AUC from the program's ``auc`` op, exact test AUC) over every full batch of ``arrays``, by
    ``program`` (default ``model.test``)."""
    program = model.test if program is None else program
    test_scope = scope.new_scope()
    for state in model.auc_states:
        test_scope.set_var(state.name, np.zeros(state.shape, np.int64))
    auc_value, scores, labels = float("nan"), [], []
    for batch in data.array_batches(arrays, batch_size):
        auc_v, predict = exe.run(program, feed=batch, fetch_list=[model.auc, model.predict], scope=test_scope)
        auc_value = float(np.asarray(auc_v).ravel()[0])
        scores.append(predict[:, 1])
        labels.append(batch["label"])
    if not scores:
        raise FlotillaError(f"the test set has fewer than one batch of {batch_size} examples",
                            hint="generate more examples or lower --batch-size")
    return auc_value, roc_auc(np.concatenate(scores), np.concatenate(labels))


def ensure_data(data_dir: pathlib.Path, generate: int, seed: int) -> tuple[pathlib.Path, pathlib.Path]:
    """``data_dir``'s train and test files, generated first when either is missing.

    The files are written in a private directory and renamed into place (an atomic replace), so
    several trainers may generate at once: each reads complete files, and all of them the same ones
    (generation is deterministic in ``seed``)."""
    train_path, test_path = data_dir / "train.txt", data_dir / "test.txt"
    if train_path.exists() and test_path.exists():
        return train_path, test_path
    print(f"generating {generate} training and {generate // 5} test examples in {data_dir}/", flush=True)
    staging = data_dir / f".generating-{os.getpid()}"
    try:
        new_train, new_test = data.generate_split(staging, generate, generate // 5, seed=seed)
        os.replace(new_train, train_path)
        os.replace(new_test, test_path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return train_path, test_path


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Train and evaluate; returns ``{"steps", "final_loss", "train_auc", "test_auc", "test_auc_exact",
    "examples_per_s"}`` (a pserver returns ``{}``; a trainer other than 0 has NaN test AUCs)."""
    args = parse_args(argv)
    model = build_model(args.hash_dim, embedding_dim=args.embedding_dim, hidden=args.hidden,
                        optimizer_name=args.optimizer, learning_rate=args.lr, is_distributed=args.distributed_table)
    job = cluster.distribute_from_args(model.main, model.startup, args)
    if job.is_pserver:
        return {}
    tag = job.tag

    train_path, test_path = ensure_data(pathlib.Path(args.data_dir), args.generate, args.seed)
    train = data.load_arrays(train_path, args.hash_dim)
    test = data.load_arrays(test_path, args.hash_dim)
    print(f"{tag}{len(train['label'])} training, {len(test['label'])} test examples; hash_dim {args.hash_dim}",
          flush=True)

    scope = runtime.Scope()
    exe = runtime.Executor(runtime.CPUPlace())
    exe.run(job.startup, scope=scope)

    step, examples, loss, train_auc = 0, 0, float("nan"), float("nan")
    start = window_start = time.perf_counter()
    window_examples = 0
    num_batches = len(train["label"]) // args.batch_size
    for epoch in range(args.epochs):
        batches = data.array_batches(train, args.batch_size, seed=args.seed * 1000 + epoch)
        for batch in job.shard(batches, total=num_batches):
            loss_v, auc_v = exe.run(job.main, feed=batch, fetch_list=[model.loss, model.auc], scope=scope)
            step += 1
            n = len(batch["label"])
            examples += n
            window_examples += n
            loss, train_auc = float(loss_v.ravel()[0]), float(auc_v.ravel()[0])
            if step % args.log_every == 0:
                now = time.perf_counter()
                print(f"{tag}epoch {epoch} step {step:5d}  loss {loss:.4f}  AUC {train_auc:.4f}  "
                      f"{window_examples / (now - window_start):,.0f} examples/s", flush=True)
                window_start, window_examples = now, 0
    elapsed = time.perf_counter() - start
    print(f"{tag}trained {step} steps ({examples} examples) in {elapsed:.1f}s, {examples / elapsed:,.0f} examples/s",
          flush=True)

    test_auc = test_auc_exact = float("nan")
    if job.trainer_id == 0:
        # A distributed table lives on the pservers: evaluate with the transpiled forward pass, which
        # prefetches its rows. The pservers are still serving: this trainer has not completed yet.
        program = cluster.forward_prefix(job.main) if job.is_distributed else model.test
        test_auc, test_auc_exact = evaluate(exe, model, scope, test, args.batch_size, program)
        print(f"{tag}test AUC: {test_auc:.3f} (exact: {test_auc_exact:.3f})", flush=True)
    exe.close()
    return {"steps": step, "final_loss": loss, "train_auc": train_auc, "test_auc": test_auc,
            "test_auc_exact": test_auc_exact, "examples_per_s": examples / elapsed}


if __name__ == "__main__":
    main()
