"""A lone pserver process for the trust tests: ``python -m tests.runtime.rpc.lone_pserver ENDPOINT [--width W]``.

Serves, on ``ENDPOINT`` (bound exactly as given), the only pserver of an fc model x[W] -> fc 256 (``fc_w``:
W x 256 float32, 1 KiB a row) -> square error, SGD, transpiled for one trainer in sync mode, until the trainer
completes or the process is killed. The settings (token, opt-out) come from the environment as for any pserver.
"""
from __future__ import annotations

import argparse
import sys

import runtime
from flotilla.fluid import layers, optimizer
from flotilla.fluid.param_attr import ParamAttr
from ir.core import Program, program_guard
from ir.names import unique_name
from transpiler import DistributeTranspiler

OUT = 256


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("--width", type=int, default=512)
    args = ap.parse_args(argv)
    main_p, startup = Program(), Program()
    with unique_name.guard(), program_guard(main_p, startup):
        x = layers.data(name="x", shape=[args.width], dtype="float32")
        pred = layers.fc(input=x, size=OUT, param_attr=ParamAttr(name="fc_w"), bias_attr=ParamAttr(name="fc_b"))
        y = layers.data(name="y", shape=[OUT], dtype="float32")
        optimizer.SGD(learning_rate=0.1).minimize(layers.mean(layers.square_error_cost(input=pred, label=y)))
    t = DistributeTranspiler()
    t.transpile(0, program=main_p, startup_program=startup, pservers=args.endpoint, trainers=1, sync_mode=True)
    serve, serve_startup = t.get_pserver_programs(args.endpoint)
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(serve_startup, scope=scope)
    exe.run(serve, scope=scope)
    return 0


if __name__ == "__main__":
    sys.exit(main())
