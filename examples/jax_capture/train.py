"""Train a Transformer encoder written in plain JAX, captured as a Flotilla Program:
``python examples/jax_capture/train.py [--steps S] [--batch-size B] [--lr LR] [--seed SEED] [--print-program]``.

The model is ``examples/jax_capture/models.py``'s ``transformer_loss(params, batch)``: no Flotilla API.
``flotilla.jax.capture`` traces it into main and startup Programs (Adam appended), which run through
``runtime.Executor`` like any other program. Distributed like every example (``flotilla.cluster``):
``flotilla launch --nproc_per_node 2 examples/jax_capture/train.py`` trains it with allreduce (nccl2),
``--server_num/--worker_num`` on parameter servers (the token embedding then is a distributed table).
Each trainer prints ``step, loss`` lines and, at the end, ``final loss: x.xxxx``. ``main(argv)`` returns
``{"steps", "first_loss", "final_loss"}`` (a pserver returns ``{}``).
"""
from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import runtime  # noqa: E402
from flotilla import cluster  # noqa: E402
from examples.jax_capture import models  # noqa: E402
from flotilla.fluid import optimizer  # noqa: E402
from flotilla.jax import capture  # noqa: E402
from runtime.role import role_from_env  # noqa: E402


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Train a plain-JAX Transformer encoder captured as a Program.")
    ap.add_argument("--steps", type=int, default=20, help="training steps per trainer")
    ap.add_argument("--batch-size", type=int, default=16, help="examples a step, per trainer")
    ap.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    ap.add_argument("--seed", type=int, default=0, help="seeds the parameters and the data")
    ap.add_argument("--log-every", type=int, default=5, help="steps between progress lines")
    ap.add_argument("--print-program", action="store_true", help="print the captured main program")
    cluster.add_arguments(ap)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    role = role_from_env()
    if role.is_collective and role.is_trainer and role.trainers > 1:
        # capture lowers the opaque ops, which starts JAX: join the trainer group before that.
        from runtime.collective import join_group

        join_group(role.trainer_id, list(role.trainer_endpoints))

    params = models.transformer_init(args.seed)
    total = args.steps * max(role.trainers, 1)
    data = models.transformer_batches(args.seed + 1, total, args.batch_size)
    main_p, startup, loss = capture(models.transformer_loss, params, data[0], optimizer=optimizer.Adam(args.lr),
                                    distributed=["tok"] if role.is_distributed else ())
    if args.print_program:
        print(main_p)
    job = cluster.distribute_from_args(main_p, startup, args, role=role)
    if job.is_pserver:
        return {}
    exe, scope = runtime.Executor(runtime.CPUPlace()), runtime.Scope()
    exe.run(job.startup, scope=scope)
    step, first, value = 0, float("nan"), float("nan")
    for batch in job.shard(data, total=total):
        (out,) = exe.run(job.main, feed=batch, fetch_list=[loss], scope=scope)
        step += 1
        value = float(out.reshape(-1)[0])
        first = value if step == 1 else first
        if step % args.log_every == 0:
            print(f"{job.tag}step {step:4d}  loss {value:.4f}", flush=True)
    print(f"{job.tag}final loss: {value:.4f}", flush=True)
    exe.close()
    return {"steps": step, "first_loss": first, "final_loss": value}


if __name__ == "__main__":
    main()
