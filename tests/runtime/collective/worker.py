"""A collective trainer for the tests: ``python -m tests.runtime.collective.worker --out DIR [...]``.

Joins the group from its role (``--rank``/``--endpoints``, or Paddle's environment as ``flotilla launch``
sets it), then trains each configuration of ``CONFIGS`` named by ``--configs`` for ``STEPS`` steps on its
shard (rows ``rank::nranks``) of every batch, one group for all of them, and saves each configuration's
parameters to ``DIR/<config>.rank<r>.npz``. ``--die-at-step K`` makes it exit abruptly (status 3) before
step K of the first configuration, as a crashed trainer would. ``--lr-factor F`` scales the learning
rate and ``--momentum MU`` sets Momentum's (0.9) (a rank given another value runs another program). ``--steps N`` trains N steps instead of ``STEPS``; ``--pause S`` sleeps S seconds after each step of
the first configuration and prints ``trainer <r>: step <k> done`` (a job that is still running when a
test takes a host down). ``--devices`` (with
``XLA_FLAGS=--xla_force_host_platform_device_count=N``, one process) trains through
``CompiledProgram.with_data_parallel`` instead.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

import runtime
from flotilla.fluid import layers, optimizer
from ir.core import Parameter, Program, program_guard
from ir.names import unique_name
from flotilla.fluid.param_attr import ParamAttr
from transpiler import CompiledProgram, DistributeTranspiler, DistributeTranspilerConfig

STEPS = 5
ROWS = 8  # rows a step, split over the ranks
# name: (optimizer, transpiler config fields)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "momentum_fused": ("momentum", {}),
    "adam_unfused": ("adam", {"fuse_grad_size_in_MB": 0}),
    "sgd_allreduce": ("sgd", {}),
    "sgd_local_sgd_k1": ("sgd", {"mode": "collective", "collective_mode": "local_sgd", "local_sgd_steps": 1}),
    "momentum_local_sgd_k1": ("momentum", {"mode": "collective", "collective_mode": "local_sgd"}),
    "sgd_local_sgd_k2": ("sgd", {"mode": "collective", "collective_mode": "local_sgd", "local_sgd_steps": 2}),
    "sparse_embedding_sgd": ("sparse_sgd", {}),
    "dgc": ("dgc", {}),
    "dgc_dense": ("dgc_dense", {}),
    "dgc_static": ("dgc_static", {}),
}
# DGCMomentumOptimizer's settings in the "dgc" configuration (every parameter compressed, however small), and "dgc_dense"
# (compression never starts within the run: dense allreduce + momentum).
DGC_ATTRS: dict[str, Any] = {"mu": 0.9, "use_nesterov": False, "rampup_begin_step": 2, "rampup_step": 2,
                             "sparsity": [0.75, 0.9], "local_grad_clip_norm": 1.0, "num_trainers": 0}


# "dgc_static": compression from step 0 at one sparsity (no lax.switch; the pairs go through the shared-memory
# arena when the trainers have one).
DGC_STATIC_ATTRS: dict[str, Any] = {**DGC_ATTRS, "rampup_begin_step": 0, "rampup_step": 1, "sparsity": [0.75],
                                    "local_grad_clip_norm": -1.0}


def _dgc(lr: float, dense: bool = False, attrs: dict[str, Any] = DGC_ATTRS) -> optimizer.DGCMomentumOptimizer:
    a = attrs
    clip = a["local_grad_clip_norm"]
    return optimizer.DGCMomentumOptimizer(lr, a["mu"], rampup_begin_step=1000 if dense else a["rampup_begin_step"],
                                          rampup_step=a["rampup_step"], sparsity=a["sparsity"],
                                          local_grad_clip_norm=clip if clip > 0 else None, min_compress_numel=1)


def build(opt: str, seed: int, lr_factor: float = 1.0, mu: float = 0.9) -> tuple[Program, Program, Any]:
    main, startup = Program(), Program()
    main.random_seed = startup.random_seed = seed
    with unique_name.guard(), program_guard(main, startup):
        x = layers.data(name="x", shape=[6], dtype="float32")
        y = layers.data(name="y", shape=[1], dtype="float32")
        if opt == "sparse_sgd":  # a sparse (selected-rows) embedding gradient: gathered, not densified
            ids = layers.cast(layers.scale(layers.abs(x), scale=3.0), "int64")
            emb = layers.embedding(ids, size=[20, 2], is_sparse=True, param_attr=ParamAttr(name="emb"))
            x = layers.concat([x, layers.reshape(emb, [-1, 12])], axis=1)
            opt = "sgd"
        h = layers.fc(input=x, size=12, act="relu", param_attr=ParamAttr(name="w0"), bias_attr=ParamAttr(name="b0"))
        pred = layers.fc(input=h, size=1, param_attr=ParamAttr(name="w1"), bias_attr=ParamAttr(name="b1"))
        loss = layers.mean(layers.square_error_cost(input=pred, label=y))
        {"sgd": lambda: optimizer.SGD(0.1 * lr_factor), "momentum": lambda: optimizer.Momentum(0.1 * lr_factor, mu),
         "adam": lambda: optimizer.Adam(0.05 * lr_factor), "dgc": lambda: _dgc(0.1 * lr_factor),
         "dgc_dense": lambda: _dgc(0.1 * lr_factor, dense=True),
         "dgc_static": lambda: _dgc(0.1 * lr_factor, attrs=DGC_STATIC_ATTRS)}[opt]().minimize(loss)
    return main, startup, loss


def batches(steps: int = STEPS) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(2019)
    return [(rng.normal(size=(ROWS, 6)).astype("float32"), rng.normal(size=(ROWS, 1)).astype("float32"))
            for _ in range(steps)]


def params_of(main: Program, scope: runtime.Scope) -> dict[str, np.ndarray]:
    return {n: np.asarray(scope.find_var(n)) for n, v in main.global_block().vars.items() if isinstance(v, Parameter)}


def train_single(opt: str, seed: int, steps: int = STEPS) -> dict[str, np.ndarray]:
    """One process, one device, whole batches: the reference."""
    main, startup, loss = build(opt, seed)
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    for x, y in batches(steps):
        exe.run(main, feed={"x": x, "y": y}, fetch_list=[loss], scope=scope)
    return params_of(main, scope)


def train_dgc_simulated(seed: int, nranks: int = 2, steps: int = STEPS,
                        attrs: dict[str, Any] = DGC_ATTRS) -> dict[str, np.ndarray]:
    """DGC with ``nranks`` trainers simulated in one process: each trainer's gradient on its shard comes
    from running the model's forward and backward (no optimizer) with the current parameters; the
    update is ``tests.runtime.dgc_reference.dgc_step`` (numpy, float64)."""
    from tests.runtime.dgc_reference import dgc_step

    main_p, startup, loss = build("sgd", seed)
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    params = {n: v.astype("float64") for n, v in params_of(main_p, scope).items()}
    fwd = main_p.clone()
    block = fwd.global_block()
    while block.ops and block.ops[-1].type == "sgd":
        block.remove_op(len(block.ops) - 1)
    names = sorted(params)
    us = {n: [np.zeros_like(params[n]) for _ in range(nranks)] for n in names}
    vs = {n: [np.zeros_like(params[n]) for _ in range(nranks)] for n in names}
    for step, (x, y) in enumerate(batches(steps)):
        grads: dict[str, list[np.ndarray]] = {n: [] for n in names}
        for r in range(nranks):
            for n in names:
                scope.set_var(n, params[n].astype("float32"))
            got = exe.run(fwd, feed={"x": x[r::nranks], "y": y[r::nranks]},
                          fetch_list=[f"{n}@GRAD" for n in names], scope=scope)
            for n, g in zip(names, got):
                grads[n].append(np.asarray(g, "float64"))
        for n in names:
            params[n], us[n], vs[n] = dgc_step(params[n], us[n], vs[n], grads[n], step, 0.1, attrs)
    return params


def eval_loss(params: dict[str, np.ndarray], seed: int = 100, steps: int = STEPS) -> float:
    """The model's mean loss with ``params`` over every batch of a run (forward only)."""
    main_p, startup, loss = build("sgd", seed)
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    block = main_p.global_block()
    while block.ops and block.ops[-1].type == "sgd":
        block.remove_op(len(block.ops) - 1)
    for n, v in params.items():
        scope.set_var(n, np.asarray(v, "float32"))
    return float(np.mean([np.asarray(exe.run(main_p, feed={"x": x, "y": y}, fetch_list=[loss], scope=scope)[0])
                          for x, y in batches(steps)]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--endpoints", default=None)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--die-at-step", type=int, default=None)
    ap.add_argument("--die-rank", type=int, default=None, help="only this rank dies (default: every rank given)")
    ap.add_argument("--devices", action="store_true")
    ap.add_argument("--lr-factor", type=float, default=1.0)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--pause", type=float, default=0.0)
    args = ap.parse_args(argv)
    restarted = int(os.environ.get("FLOTILLA_RESTART_COUNT", "0") or 0) > 0  # a launcher restarted it: die no more
    if args.devices:
        for name in args.configs.split(","):
            opt, _ = CONFIGS[name]
            main_p, startup, loss = build(opt, seed=100)
            exe, scope = runtime.Executor(), runtime.Scope()
            exe.run(startup, scope=scope)
            compiled = CompiledProgram(main_p).with_data_parallel(loss_name=loss.name)
            for x, y in batches():
                losses, = exe.run(compiled, feed={"x": x, "y": y}, fetch_list=[loss], scope=scope)
            np.savez(os.path.join(args.out, f"{name}.devices.npz"), losses=losses, **params_of(main_p, scope))
        return 0
    if args.rank is None:
        role = runtime.role_from_env()
        rank, endpoints = role.trainer_id, ",".join(role.trainer_endpoints)
    else:
        rank, endpoints = args.rank, args.endpoints
    nranks = len(endpoints.split(","))
    for i, name in enumerate(args.configs.split(",")):
        opt, fields = CONFIGS[name]
        # every rank its own seed: broadcast must fix it
        main_p, startup, loss = build(opt, seed=100 + rank, lr_factor=args.lr_factor, mu=args.momentum)
        config = DistributeTranspilerConfig(**{"mode": "nccl2", **fields})
        t = DistributeTranspiler(config)
        t.transpile(rank, program=main_p, startup_program=startup, trainers=endpoints)
        exe, scope = runtime.Executor(), runtime.Scope()
        exe.run(t.get_trainer_startup_program(), scope=scope)
        trainer = t.get_trainer_program()
        for step, (x, y) in enumerate(batches(args.steps)):
            if i == 0 and args.die_at_step == step and args.die_rank in (None, rank) and not restarted:
                print(f"trainer {rank}: dying before step {step}", flush=True)
                os._exit(3)
            exe.run(trainer, feed={"x": x[rank::nranks], "y": y[rank::nranks]}, fetch_list=[loss], scope=scope)
            if i == 0 and args.pause:
                print(f"trainer {rank}: step {step} done", flush=True)
                time.sleep(args.pause)
        np.savez(os.path.join(args.out, f"{name}.rank{rank}.npz"), **params_of(main_p, scope))
        print(f"trainer {rank}: {name} done", flush=True)
    from runtime import collective

    print(f"trainer {rank}: dense sums through {'shared memory' if collective._arena else 'XLA'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
