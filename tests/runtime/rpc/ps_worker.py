"""One process of a test cluster: a pserver or a trainer, its role from Paddle's environment variables.

``python -m tests.runtime.rpc.ps_worker --out DIR [--model fc|table] [--opt sgd|momentum|adam]
[--lr const|exp] [--async] [--steps N] [--first-step S] [--save-at K --ckpt DIR] [--load DIR] [--hold]
[--die-at K] [--sleep S] [--resume] [--geo K] [--hybrid]``

A pserver runs its startup program (then loads ``--load``'s checkpoint), saves its initial state to
``DIR/pserver_<id>_init.npz``, serves, and saves its final state to ``DIR/pserver_<id>.npz``. A trainer
runs its startup program, saves the parameters it received to ``DIR/trainer_<id>_init.npz``, trains on
``batch(trainer_id, step)`` for steps ``first-step .. first-step + steps - 1``, saves the parameters it
holds to ``DIR/trainer_<id>.npz`` and closes its executor (sending Complete). ``--save-at K`` makes
trainer 0 save a checkpoint after K steps (``--hold`` then keeps every trainer alive until killed);
``--die-at K`` makes the trainer SIGKILL itself at the start of step K (only trainer ``--die-rank R`` when
given; never a trainer the launcher restarted, ``FLOTILLA_RESTART_COUNT`` > 0, which resumes as with
``--resume``). ``--resume`` (a restarted trainer)
starts at the step the pservers admit it at (its client's step after the startup program) instead of
``--first-step``, and trains up to the same last step. ``--geo K`` (with ``--async``) transpiles in Geo-SGD
mode syncing every K steps; a trainer then also saves its losses to ``DIR/trainer_<id>_loss.npy``.
``--hybrid`` transpiles in hybrid mode (``PADDLE_TRAINER_ENDPOINTS`` must list the trainers): the dense
parameters are allreduced among the trainers, the distributed table stays on the pservers.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys
import time
from typing import Any

import numpy as np

from flotilla.fluid import layers, learning_rate, optimizer
from ir.core import Program, program_guard
from ir.names import unique_name
from flotilla.fluid.param_attr import ParamAttr
from transpiler import DistributeTranspiler, DistributeTranspilerConfig

DIM, HIDDEN, TABLE_ROWS, EMB = 12, 40, 101, 4
BATCH = 8
DENSE_PARAMS = ("fc_w", "fc_b", "out_w", "out_b")


def build(model: str, opt: str, lr: str) -> tuple[Program, Program]:
    """x[DIM] (+ an embedding of ids for ``table``) → fc HIDDEN relu → fc 1 → square error, in float64 so
    distributed and local training agree to rounding of a few ulps."""
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        x = layers.data("x", [DIM], dtype="float64")
        if model == "table":
            ids = layers.data("ids", [1], dtype="int64")
            emb = layers.embedding(ids, size=[TABLE_ROWS, EMB], is_sparse=True, is_distributed=True,
                                   dtype="float64", param_attr=ParamAttr(name="table"))
            x = layers.concat([x, emb], axis=1)
        h = layers.fc(x, HIDDEN, act="relu", param_attr=ParamAttr(name="fc_w"), bias_attr=ParamAttr(name="fc_b"))
        pred = layers.fc(h, 1, param_attr=ParamAttr(name="out_w"), bias_attr=ParamAttr(name="out_b"))
        y = layers.data("y", [1], dtype="float64")
        loss = layers.mean(layers.square_error_cost(pred, y))
        rate: Any = 0.05 if opt != "adam" else 0.01
        if lr == "exp":
            rate = learning_rate.exponential_decay(rate, 3, 0.8, staircase=True)
        {"sgd": lambda: optimizer.SGD(learning_rate=rate),
         "momentum": lambda: optimizer.Momentum(learning_rate=rate, momentum=0.9),
         "adam": lambda: optimizer.Adam(learning_rate=rate)}[opt]().minimize(loss)
    return main, startup


def batch(model: str, trainer_id: int, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 * trainer_id + step)
    feed = {"x": rng.normal(size=(BATCH, DIM)), "y": rng.normal(size=(BATCH, 1))}
    if model == "table":
        feed["ids"] = rng.integers(0, TABLE_ROWS, size=(BATCH, 1)).astype(np.int64)
    return feed


def transpiler(args: argparse.Namespace, role: Any) -> tuple[DistributeTranspiler, Program]:
    main, startup = build(args.model, args.opt, args.lr)
    config = DistributeTranspilerConfig()
    config.min_block_size = 64  # fc_w (12 x 40) is sliced over the pservers
    if args.geo:
        config.geo_sgd_mode, config.geo_sgd_need_push_nums = True, args.geo
    trainers: Any = role.trainers
    if getattr(args, "hybrid", False):  # callers that build their own Namespace leave it out
        config.mode, trainers = "hybrid", ",".join(role.trainer_endpoints)
    t = DistributeTranspiler(config)
    t.transpile(role.trainer_id, program=main, startup_program=startup, pservers=role.pservers,
                trainers=trainers, sync_mode=not args.async_mode)
    return t, main


def save(path: pathlib.Path, scope: Any, names: list[str]) -> None:
    np.savez(path, **{n: scope.numpy(n) for n in names if scope.find_var(n) is not None})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--model", choices=("fc", "table"), default="fc")
    ap.add_argument("--opt", choices=("sgd", "momentum", "adam"), default="sgd")
    ap.add_argument("--lr", choices=("const", "exp"), default="const")
    ap.add_argument("--async", dest="async_mode", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--first-step", type=int, default=0)
    ap.add_argument("--save-at", type=int, default=-1)
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--load", default="")
    ap.add_argument("--hold", action="store_true")
    ap.add_argument("--die-at", type=int, default=-1)
    ap.add_argument("--die-rank", type=int, default=-1, help="only this trainer dies at --die-at (default: any)")
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--geo", type=int, default=0)
    ap.add_argument("--hybrid", action="store_true")
    args = ap.parse_args()

    import runtime
    from runtime import io
    from runtime.role import role_from_env

    role = role_from_env()
    t, _ = transpiler(args, role)
    exe, scope = runtime.Executor(), runtime.Scope()
    if role.is_pserver:
        prog, startup = t.get_pserver_programs(role.current_endpoint)
        exe.run(startup, scope=scope)
        if args.load:
            io.load_persistables(exe, args.load, prog, scope=scope)
        names = [v.name for v in prog.global_block().vars.values() if v.is_parameter]
        me = role.pserver_index
        save(args.out / f"pserver_{me}_init.npz", scope, names)
        exe.run(prog, scope=scope)
        save(args.out / f"pserver_{me}.npz", scope, names)
        return 0

    prog, startup = t.get_trainer_program(), t.get_trainer_startup_program()
    exe.run(startup, scope=scope)
    # A Geo-SGD trainer holds the distributed table too.
    names = [n for n in (*DENSE_PARAMS, *(["table"] if args.geo else [])) if prog.global_block().has_var(n)]
    save(args.out / f"trainer_{role.trainer_id}_init.npz", scope, names)
    first = args.first_step
    restarted = int(os.environ.get("FLOTILLA_RESTART_COUNT", "0") or 0) > 0  # started again by the launcher
    if args.resume or restarted:
        first = exe.rpc_session.client(role.trainer_id).step
        print(f"trainer {role.trainer_id} resumes at step {first}", flush=True)
    loss = [op.output("Out")[0] for op in prog.global_block().ops if op.type == "mean"][:1] if args.geo else []
    losses = []
    for step in range(first, args.first_step + args.steps):
        if step == args.die_at and not restarted and args.die_rank in (-1, role.trainer_id):
            os.kill(os.getpid(), signal.SIGKILL)
        losses += exe.run(prog, feed=batch(args.model, role.trainer_id, step), fetch_list=loss, scope=scope)
        print(f"trainer {role.trainer_id} step {step}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)
        if step + 1 == args.save_at and role.trainer_id == 0:
            io.save_persistables(exe, args.ckpt, prog, scope=scope)
            (args.out / "saved").write_text("ok")
    if args.hold:
        while True:
            time.sleep(1)
    save(args.out / f"trainer_{role.trainer_id}.npz", scope, names)
    if args.geo:
        np.save(args.out / f"trainer_{role.trainer_id}_loss.npy", np.array([float(np.mean(v)) for v in losses]))
    state = exe.rpc_session.client(role.trainer_id).data_plane_state()
    print("data plane: " + (", ".join(f"{ep} {how}" for ep, how in state.items()) or "unused"), flush=True)
    exe.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
