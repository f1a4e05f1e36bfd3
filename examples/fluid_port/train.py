"""The Fluid 1.5 cluster manual's parameter-server script, ported by changing one import line.

Everything below the import is written against ``fluid`` exactly as a Fluid 1.5 user would: a model with
variable-length id sequences (``lod_level=1``, fed through ``fluid.DataFeeder``), a learning-rate
schedule from ``fluid.layers``, ``fluid.memory_optimize``, the role taken from Paddle's environment
variables, and ``DistributeTranspiler.transpile`` rewriting the default programs in place, so the trainer
runs ``fluid.default_startup_program()`` (which receives the parameters from the pservers) as in Fluid.

Run it distributed (``flotilla launch --server_num 2 --worker_num 2 examples/fluid_port/train.py``) or
alone (no role variables: one local trainer). The task: each example is a sequence of word ids whose
target is the mean of hidden per-word scores; the model averages learned word embeddings
(``sequence_pool``) and regresses with ``fc``. Each trainer prints ``trainer <id>: test loss A -> B``
(before and after training, on held-out sequences).
"""
from __future__ import annotations

import os
import pathlib
import sys

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from flotilla import fluid  # noqa: E402  (was: import paddle.fluid as fluid)

VOCAB = 500
EMB_DIM = 16
BATCH_SIZE = 32
EPOCH_NUM = int(os.getenv("FLUID_PORT_EPOCHS", "4"))
TRAIN_SIZE = 2048
TEST_SIZE = 512


def reader(size: int, seed: int):
    """A Fluid-style sample reader: (ids, [target]) with ids of length 2..12."""
    scores = np.random.RandomState(1234).normal(0.0, 1.0, VOCAB).astype("float32")

    def read():
        rng = np.random.RandomState(seed)
        for _ in range(size):
            ids = rng.randint(0, VOCAB, rng.randint(2, 13))
            yield [[int(i)] for i in ids], [float(scores[ids].mean())]
    return read


def batch(read, batch_size: int):
    """``paddle.batch``: groups samples into lists of ``batch_size``."""
    def batched():
        buf = []
        for sample in read():
            buf.append(sample)
            if len(buf) == batch_size:
                yield buf
                buf = []
    return batched


def train() -> None:
    ids = fluid.layers.data(name="ids", shape=[1], dtype="int64", lod_level=1)
    y = fluid.layers.data(name="y", shape=[1], dtype="float32")
    emb = fluid.layers.embedding(input=ids, size=[VOCAB, EMB_DIM], is_sparse=True)
    pooled = fluid.layers.sequence_pool(input=emb, pool_type="average")
    y_predict = fluid.layers.fc(input=pooled, size=1, act=None)
    avg_loss = fluid.layers.mean(fluid.layers.square_error_cost(input=y_predict, label=y))
    test_program = fluid.default_main_program().clone(for_test=True)

    lr = fluid.layers.exponential_decay(learning_rate=1.0, decay_steps=100, decay_rate=0.8, staircase=True)
    opt = fluid.optimizer.SGD(learning_rate=lr)
    opt.minimize(avg_loss)
    fluid.memory_optimize(fluid.default_main_program(), skip_grads=True)

    place = fluid.CPUPlace()
    feeder = fluid.DataFeeder(place=place, feed_list=[ids, y])
    exe = fluid.Executor(place)

    # the distributed training environment
    training_role = os.getenv("TRAINING_ROLE", "TRAINER")
    pserver_endpoints = os.getenv("PADDLE_PSERVERS_IP_PORT_LIST", "")
    trainers = int(os.getenv("PADDLE_TRAINERS_NUM", "1"))
    trainer_id = int(os.getenv("PADDLE_TRAINER_ID", "0"))
    current_endpoint = os.getenv("POD_IP", "127.0.0.1") + ":" + os.getenv("PADDLE_PORT", "6174")

    if pserver_endpoints:
        t = fluid.DistributeTranspiler()
        t.transpile(trainer_id=trainer_id, pservers=pserver_endpoints, trainers=trainers)

    if training_role == "PSERVER":
        pserver_prog = t.get_pserver_program(current_endpoint)
        pserver_startup = t.get_startup_program(current_endpoint, pserver_prog)
        exe.run(pserver_startup)
        exe.run(pserver_prog)
    elif training_role == "TRAINER":
        exe.run(fluid.default_startup_program())
        test_data = next(batch(reader(TEST_SIZE, seed=99), TEST_SIZE)())

        def test_loss() -> float:
            (value,) = exe.run(test_program, feed=feeder.feed(test_data), fetch_list=[avg_loss])
            return float(value[0])

        before = test_loss()
        train_reader = batch(reader(TRAIN_SIZE, seed=trainer_id), BATCH_SIZE)
        for epoch in range(EPOCH_NUM):
            for batch_id, batch_data in enumerate(train_reader()):
                (loss,) = exe.run(fluid.default_main_program(), feed=feeder.feed(batch_data),
                                  fetch_list=[avg_loss])
                if (batch_id + 1) % 32 == 0:
                    print(f"trainer {trainer_id}: epoch {epoch} batch {batch_id + 1} loss {float(loss[0]):.4f}",
                          flush=True)
        print(f"trainer {trainer_id}: test loss {before:.4f} -> {test_loss():.4f}", flush=True)
        exe.close()  # tells the pservers this trainer is done
    else:
        raise SystemExit(f"TRAINING_ROLE should be TRAINER or PSERVER, got {training_role!r}")


if __name__ == "__main__":
    train()
