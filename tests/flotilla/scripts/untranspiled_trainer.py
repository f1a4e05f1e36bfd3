"""A script with the silent mistake of issue 12: it transpiles with the native API (``program=`` given, so
the programs are left untouched) and then runs the untranspiled startup and main programs. A trainer must
stop at once with ``UntranspiledProgramError`` naming the program to run; pservers serve as usual (the
launcher stops them when the trainer fails)."""
from __future__ import annotations

import pathlib
import sys

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))

import ir  # noqa: E402
import runtime  # noqa: E402
from flotilla.fluid import layers, optimizer  # noqa: E402
from transpiler import DistributeTranspiler  # noqa: E402


def main() -> None:
    main_p, startup = ir.Program(), ir.Program()
    with ir.program_guard(main_p, startup):
        x = layers.data(name="x", shape=[4], dtype="float32")
        loss = layers.mean(layers.fc(input=x, size=1))
        optimizer.SGD(0.1).minimize(loss)
    role = runtime.role_from_env()
    t = DistributeTranspiler()
    t.transpile(role.trainer_id, program=main_p, startup_program=startup, pservers=role.pservers,
                trainers=role.trainers)
    exe = runtime.Executor(runtime.CPUPlace())
    if role.is_pserver:
        pserver_main, pserver_startup = t.get_pserver_programs(role.current_endpoint)
        exe.run(pserver_startup)
        exe.run(pserver_main)
        return
    exe.run(startup)  # the mistake: t.get_trainer_startup_program() was meant
    exe.run(main_p, feed={"x": np.zeros((2, 4), "float32")})


if __name__ == "__main__":
    main()
