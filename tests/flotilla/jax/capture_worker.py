"""A process of the capture tests' clusters: ``python -m tests.flotilla.jax.capture_worker --out DIR --model M
[--rank R --endpoints E]``.

The model (``examples.jax_capture.models``) is captured in every process from the same initial values.
Pserver mode (role from Paddle's environment, as ``tests/runtime/rpc`` sets it): a pserver serves and saves
its parameter blocks to ``DIR/pserver_<i>.npz``; trainer ``t`` trains ``STEPS`` steps on rows
``[t*R, (t+1)*R)`` of each global batch and saves the parameters it holds to ``DIR/trainer_<t>.npz``.
nccl2 mode (``--rank``/``--endpoints``): rank ``r`` trains on rows ``r::nranks`` of each global batch
and saves its parameters to ``DIR/rank<r>.npz``.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

STEPS = 5
ROWS = 16  # rows of a global batch


def build(model: str) -> tuple[Any, Any, Any, list[dict[str, np.ndarray]]]:
    """(main, startup, loss, global batches) of a captured model: CTR with SGD and a distributed table,
    the others with Adam."""
    from examples.jax_capture import models as M
    from flotilla.fluid import optimizer
    from flotilla.jax import capture

    loss_fn, init, batches = M.MODELS[model]
    data = batches(1, STEPS, ROWS)
    if model == "ctr":
        main, startup, loss = capture(loss_fn, init(0), data[0], optimizer=optimizer.SGD(0.5), distributed=["emb"])
    else:
        main, startup, loss = capture(loss_fn, init(0), data[0], optimizer=optimizer.Adam(1e-3))
    return main, startup, loss, data


def param_names(program: Any) -> list[str]:
    return [v.name for v in program.global_block().vars.values() if v.is_parameter]


def save(path: str, scope: Any, names: list[str]) -> None:
    np.savez(path, **{n: np.asarray(scope.find_var(n)) for n in names if scope.find_var(n) is not None})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="ctr")
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--endpoints", default=None)
    args = ap.parse_args(argv)

    import runtime
    from transpiler import DistributeTranspiler, DistributeTranspilerConfig

    if args.rank is not None:
        # Capturing lowers the opaque ops, which starts JAX's backend: join the group first (the
        # startup program's gen_nccl_id then finds this very group).
        from runtime.collective import join_group

        join_group(args.rank, args.endpoints.split(","))
    main_p, startup, loss, data = build(args.model)
    exe, scope = runtime.Executor(), runtime.Scope()
    if args.rank is not None:  # nccl2
        nranks = len(args.endpoints.split(","))
        t = DistributeTranspiler(DistributeTranspilerConfig(mode="nccl2"))
        t.transpile(args.rank, program=main_p, startup_program=startup, trainers=args.endpoints)
        exe.run(t.get_trainer_startup_program(), scope=scope)
        prog = t.get_trainer_program()
        for batch in data:
            exe.run(prog, feed={k: v[args.rank::nranks] for k, v in batch.items()}, fetch_list=[loss], scope=scope)
        save(os.path.join(args.out, f"rank{args.rank}.npz"), scope, param_names(main_p))
        return 0

    role = runtime.role_from_env()
    config = DistributeTranspilerConfig()
    config.min_block_size = 64  # fc1.w (13 x 16) is sliced over the pservers
    t = DistributeTranspiler(config)
    t.transpile(role.trainer_id, program=main_p, startup_program=startup, pservers=role.pservers,
                trainers=role.trainers, sync_mode=True)
    if role.is_pserver:
        prog, pstartup = t.get_pserver_programs(role.current_endpoint)
        exe.run(pstartup, scope=scope)
        exe.run(prog, scope=scope)
        save(os.path.join(args.out, f"pserver_{role.pserver_index}.npz"), scope,
             [v.name for v in prog.global_block().vars.values() if v.persistable and v.type != "selected_rows"])
        return 0
    prog, tstartup = t.get_trainer_program(), t.get_trainer_startup_program()
    exe.run(tstartup, scope=scope)
    rows = ROWS // role.trainers
    lo = role.trainer_id * rows
    for batch in data:
        exe.run(prog, feed={k: v[lo:lo + rows] for k, v in batch.items()}, scope=scope)
    save(os.path.join(args.out, f"trainer_{role.trainer_id}.npz"), scope, param_names(prog))
    exe.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
