"""A Fluid 1.5 nccl2-mode script, with only its import line changed: the role from Paddle's environment,
``DistributeTranspilerConfig.mode = "nccl2"``, an in-place ``transpile``, ``exe.run(default_startup_program())``
(which joins the trainer group and takes trainer 0's parameters), then ``ParallelExecutor`` with
``num_trainers``. Prints ``trainer <id>: loss A -> B, weights <checksum>``.
Run: ``flotilla launch --nproc_per_node 2 tests/flotilla/scripts/fluid_nccl2.py``."""
from __future__ import annotations

import os
import pathlib
import sys

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))

from flotilla import fluid  # noqa: E402  (was: import paddle.fluid as fluid)


def main() -> None:
    x = fluid.layers.data(name="x", shape=[4], dtype="float32")
    y = fluid.layers.data(name="y", shape=[1], dtype="float32")
    pred = fluid.layers.fc(input=x, size=1, param_attr=fluid.ParamAttr(name="w"))
    loss = fluid.layers.mean(fluid.layers.square_error_cost(input=pred, label=y))
    fluid.optimizer.SGD(learning_rate=0.05).minimize(loss)

    trainer_id = int(os.getenv("PADDLE_TRAINER_ID", "0"))
    endpoints = os.getenv("PADDLE_TRAINER_ENDPOINTS")
    current_endpoint = os.getenv("PADDLE_CURRENT_ENDPOINT")
    trainers = len(endpoints.split(","))
    config = fluid.DistributeTranspilerConfig()
    config.mode = "nccl2"
    t = fluid.DistributeTranspiler(config=config)
    t.transpile(trainer_id, trainers=endpoints, current_endpoint=current_endpoint,
                startup_program=fluid.default_startup_program())

    exe = fluid.Executor(fluid.CPUPlace())
    exe.run(fluid.default_startup_program())
    pe = fluid.ParallelExecutor(use_cuda=False, loss_name=loss.name, num_trainers=trainers, trainer_id=trainer_id)
    rng = np.random.RandomState(0)
    true_w = np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")
    losses = []
    for _ in range(40):
        xs = rng.normal(size=(16, 4)).astype("float32")
        shard = slice(trainer_id, None, trainers)
        (value,) = pe.run(fetch_list=[loss.name], feed={"x": xs[shard], "y": (xs @ true_w)[shard]})
        losses.append(float(np.mean(value)))
    weights = np.array(fluid.global_scope().find_var("w").get_tensor())  # Fluid's LoDTensor surface
    print(f"trainer {trainer_id}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, weights {weights.sum():.6f}", flush=True)


if __name__ == "__main__":
    main()
