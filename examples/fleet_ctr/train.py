"""Fleet's "ten lines": a CTR model trained on one machine, then distributed without changing the
training code. ``python examples/fleet_ctr/train.py`` trains alone;
``flotilla launch --server_num 2 --worker_num 2 examples/fleet_ctr/train.py`` trains on two parameter
servers and two workers; ``flotilla launch --nproc_per_node 2 examples/fleet_ctr/train.py --collective``
trains two workers that average their gradients by allreduce.

The model (click logs made by ``generate``): four sparse slots of variable-length id lists (one or two ids,
``lod_level=1``, embedded and sum-pooled) and eight dense features, two fc layers, softmax cross-entropy.
The Fleet part is the block marked ``# --- Fleet``. Each worker prints ``worker <i>: trained N steps`` and
``worker <i>: test AUC 0.xxx``; worker 0 saves an inference model with ``--model-dir``.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any, Iterator, Sequence

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from flotilla import fluid  # noqa: E402

SLOTS = 4
DENSE = 8
HASH_DIM = 1000


def generate(n: int, seed: int) -> list[tuple[Any, ...]]:
    """``n`` samples ``(slot_0 ids, ..., slot_3 ids, dense, [label])``; the click probability is a
    logistic function of hidden per-id and per-feature weights."""
    weights = np.random.RandomState(7)
    id_w, dense_w = weights.normal(0, 1.5, HASH_DIM), weights.normal(0, 1.0, DENSE)
    rng = np.random.RandomState(seed)
    samples = []
    for _ in range(n):
        slots = [rng.randint(0, HASH_DIM, rng.randint(1, 3)) for _ in range(SLOTS)]
        dense = rng.normal(0, 1, DENSE).astype("float32")
        logit = sum(id_w[s].sum() for s in slots) / 2 + dense @ dense_w
        label = int(rng.uniform() < 1 / (1 + np.exp(-logit)))
        samples.append((*[[[int(i)] for i in s] for s in slots], dense.tolist(), [label]))
    return samples


def build_model(sparse: bool) -> tuple[list[Any], Any, Any]:
    """The single-machine CTR network: (feed variables, loss, click probability)."""
    slots = [fluid.layers.data(name=f"slot_{i}", shape=[1], dtype="int64", lod_level=1) for i in range(SLOTS)]
    dense = fluid.layers.data(name="dense", shape=[DENSE], dtype="float32")
    label = fluid.layers.data(name="label", shape=[1], dtype="int64")
    pooled = [fluid.layers.sequence_pool(fluid.layers.embedding(input=s, size=[HASH_DIM, 8], is_sparse=sparse),
                                         pool_type="sum") for s in slots]
    hidden = fluid.layers.fc(input=fluid.layers.concat(pooled + [dense], axis=1), size=32, act="relu")
    predict = fluid.layers.fc(input=hidden, size=2, act="softmax")
    loss = fluid.layers.mean(fluid.layers.cross_entropy(input=predict, label=label))
    return slots + [dense, label], loss, predict


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The exact ROC AUC (the probability a positive scores above a negative; ties count half)."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    for value in np.unique(scores):
        tie = scores == value
        ranks[tie] = ranks[tie].mean()
    pos = labels == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def batches(samples: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(samples) - size + 1, size):
        yield samples[start:start + size]


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description="Fleet CTR: single machine to distributed.")
    ap.add_argument("--train-size", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--async", dest="async_mode", action="store_true", help="parameter servers: async training")
    ap.add_argument("--collective", action="store_true", help="allreduce among workers (no parameter servers)")
    ap.add_argument("--model-dir", default=None, help="worker 0 saves an inference model here")
    args = ap.parse_args(argv)
    if args.collective:
        from flotilla.fleet.collective import DistributedStrategy, PaddleCloudRoleMaker, fleet
    else:
        from flotilla.fleet import DistributedStrategy, PaddleCloudRoleMaker, fleet

    feed_vars, loss, predict = build_model(sparse=not args.collective)
    test_program = fluid.default_main_program().clone(for_test=True)

    # --- Fleet: the same code runs alone, as a parameter server or worker, or as a collective worker
    fleet.init(PaddleCloudRoleMaker())
    strategy = DistributedStrategy()
    strategy.sync_mode = not args.async_mode
    optimizer = fleet.distributed_optimizer(fluid.optimizer.SGD(learning_rate=args.lr), strategy)
    optimizer.minimize(loss)
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return {}
    exe = fluid.Executor(fluid.CPUPlace())
    fleet.init_worker()
    exe.run(fleet.startup_program)
    # ---

    feeder = fluid.DataFeeder(feed_list=feed_vars, place=fluid.CPUPlace())
    me, workers = fleet.worker_index(), fleet.worker_num()
    train, test = generate(args.train_size, seed=1), generate(1024, seed=2)
    steps = 0
    for _ in range(args.epochs):
        for index, batch in enumerate(batches(train, args.batch_size)):
            if index % workers == me:  # this worker's shard
                exe.run(fleet.main_program, feed=feeder.feed(batch), fetch_list=[loss])
                steps += 1
    (probs,) = exe.run(test_program, feed=feeder.feed(test), fetch_list=[predict])
    test_auc = auc(probs[:, 1], np.array([s[-1][0] for s in test]))
    print(f"worker {me}: trained {steps} steps", flush=True)
    print(f"worker {me}: test AUC {test_auc:.3f}", flush=True)
    if args.model_dir and fleet.is_first_worker():
        fleet.save_inference_model(exe, args.model_dir, [v.name for v in feed_vars[:-1]], [predict])
    fleet.stop_worker()
    return {"steps": steps, "test_auc": test_auc}


if __name__ == "__main__":
    main()
