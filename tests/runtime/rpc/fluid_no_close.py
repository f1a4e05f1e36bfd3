"""A Fluid 1.5 parameter-server script as Paddle's manual wrote it, ``paddle.fluid`` rewritten to
``flotilla.fluid`` and nothing else, which never calls ``exe.close()``: its role comes from Paddle's
environment variables, a pserver serves, a trainer trains a few steps and prints ``trainer N done``
(with ``--fail``, trainer 0 then raises instead).

Issue 21: the executor must still send Complete when the interpreter exits, so the pservers and the
launcher finish cleanly; and a trainer whose pservers are not up must say so while it waits.
"""
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
    loss = fluid.layers.mean(fluid.layers.square_error_cost(input=fluid.layers.fc(input=x, size=1), label=y))
    fluid.optimizer.SGD(learning_rate=0.1).minimize(loss)

    role = os.environ.get("TRAINING_ROLE", "TRAINER")
    trainer_id = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    pservers = os.environ["PADDLE_PSERVERS_IP_PORT_LIST"]
    trainers = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    t = fluid.DistributeTranspiler()
    t.transpile(trainer_id, pservers=pservers, trainers=trainers)
    exe = fluid.Executor(fluid.CPUPlace())
    if role == "PSERVER":
        current = os.environ["PADDLE_CURRENT_ENDPOINT"]
        pserver_prog = t.get_pserver_program(current)
        exe.run(t.get_startup_program(current, pserver_prog))
        exe.run(pserver_prog)
        return
    exe.run(fluid.default_startup_program())
    rng = np.random.default_rng(trainer_id)
    for _ in range(3):
        exe.run(fluid.default_main_program(), feed={"x": rng.normal(size=(4, 4)).astype("float32"),
                                                    "y": rng.normal(size=(4, 1)).astype("float32")},
                fetch_list=[loss])
    if "--fail" in sys.argv and trainer_id == 0:
        raise RuntimeError("trainer 0 fails after training")
    print(f"trainer {trainer_id} done", flush=True)  # and no exe.close(), as in many Fluid scripts


if __name__ == "__main__":
    main()
