"""One training script for every role of a distributed job (parameter servers, or collective allreduce
among trainers): ``flotilla.cluster``, importable by a user's own project as by every example.

A script adds the cluster options to its parser (``add_arguments``: ``--sync``/``--async``,
``--no-slice``), builds its single-machine programs, then hands them to ``distribute``::

    job = cluster.distribute_from_args(model.main, model.startup, args)
    if job.is_pserver:            # distribute() has served until every trainer completed
        return
    exe.run(job.startup, scope=scope)
    for batch in job.shard(batches, total=num_batches):
        exe.run(job.main, feed=batch, ...)
    ...evaluate...
    exe.close()                   # tells the pservers this trainer is done

The role comes from Paddle's environment variables (``runtime.role.role_from_env``; ``flotilla launch``
sets them). Invariants:

- With no pservers and no trainer endpoints in the environment (a local run) ``distribute`` returns the
  caller's programs unchanged (the same objects) and ``shard`` yields every item: the script behaves as
  before.
- A collective trainer (``flotilla launch --nproc_per_node N``: ``PADDLE_TRAINER_ENDPOINTS`` set, no
  pservers) gets the programs of an nccl2 transpile: its startup program joins the trainer group and
  takes trainer 0's parameters, its main program averages the gradients over the trainers; ``shard``
  deals the batches as for a parameter-server trainer.
- A hybrid job (``--hybrid``, a config with ``mode="hybrid"``, under ``flotilla launch --server_num N
  --worker_num M``, which sets both the pserver and the trainer endpoints): every process transpiles in
  hybrid mode with the trainer endpoints, so the trainers allreduce the dense gradients among themselves
  and the distributed lookup table lives on the pservers.
- A pserver transpiles, runs its startup program, serves its program until every trainer has sent
  Complete, and returns a job with ``is_pserver`` set; it never touches the script's data.
- A trainer gets the transpiled trainer programs; ``shard`` gives it the items whose index is
  ``trainer_id`` modulo the number of trainers, and (with ``total``) the same count as every other
  trainer, so no trainer waits on a finished one in sync mode while that one evaluates.
- ``forward_prefix`` keeps a transpiled trainer program's forward pass, prefetches of a distributed
  lookup table included: the test program of a model whose table lives on the pservers.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Iterable, Iterator, TypeVar

import ir
import runtime
from ir.roles import OpRole
from runtime.role import Role, role_from_env
from transpiler import DistributeTranspiler, DistributeTranspilerConfig

T = TypeVar("T")


@dataclass(frozen=True)
class Distributed:
    """A process's programs and place in the job.

    ``main``/``startup`` are what this process runs: the caller's programs (local), the transpiled
    trainer programs (trainer), or the pserver programs it has already served (pserver).
    """

    role: Role
    main: ir.Program
    startup: ir.Program

    @property
    def is_distributed(self) -> bool:
        """Several processes train together (parameter servers, or collective)."""
        return self.role.is_distributed or (self.role.is_collective and self.role.trainers > 1)

    @property
    def is_collective(self) -> bool:
        return self.role.is_collective

    @property
    def is_pserver(self) -> bool:
        return self.role.is_pserver

    @property
    def trainer_id(self) -> int:
        return self.role.trainer_id

    @property
    def trainers(self) -> int:
        return self.role.trainers

    @property
    def tag(self) -> str:
        """A prefix for progress lines: ``"trainer 1: "`` in a distributed job, ``""`` locally."""
        return f"trainer {self.role.trainer_id}: " if self.is_distributed else ""

    def shard(self, items: Iterable[T], total: int | None = None) -> Iterator[T]:
        """This trainer's share of ``items``: index ``i`` with ``i % trainers == trainer_id``.

        With ``total`` (the number of ``items``) only the first ``trainers * (total // trainers)`` items
        are dealt, so every trainer gets ``total // trainers`` of them.
        """
        limit = None if total is None else self.trainers * (total // self.trainers)
        for index, item in enumerate(items):
            if limit is not None and index >= limit:
                return
            if index % self.trainers == self.trainer_id:
                yield item


def distribute(main: ir.Program, startup: ir.Program, *, sync_mode: bool = True,
               config: DistributeTranspilerConfig | None = None, role: Role | None = None) -> Distributed:
    """This process's programs for ``role`` (by default the environment's; see the module docstring).

    A pserver runs its startup program and serves, blocking until every trainer has completed, then
    returns a job whose ``is_pserver`` is True: the caller should simply return (exit 0).
    """
    role = role_from_env() if role is None else role
    if role.is_collective and role.is_trainer:
        config = config or DistributeTranspilerConfig()
        if not config.is_collective:
            config = dataclasses.replace(config, mode="nccl2")
        t = DistributeTranspiler(config)
        t.transpile(role.trainer_id, program=main, startup_program=startup,
                    trainers=",".join(role.trainer_endpoints), current_endpoint=role.current_endpoint)
        return Distributed(role, t.get_trainer_program(), t.get_trainer_startup_program())
    if not role.is_distributed:
        return Distributed(role, main, startup)
    t = DistributeTranspiler(config)
    trainers, own_endpoint = role.ps_transpile_peers(config is not None and config.is_hybrid)
    t.transpile(role.trainer_id, program=main, startup_program=startup, pservers=role.pservers,
                trainers=trainers, sync_mode=sync_mode, current_endpoint=own_endpoint)
    if role.is_trainer:
        return Distributed(role, t.get_trainer_program(), t.get_trainer_startup_program())
    program, pserver_startup = t.get_pserver_programs(role.current_endpoint)
    exe, scope = runtime.Executor(runtime.CPUPlace()), runtime.Scope()
    exe.run(pserver_startup, scope=scope)
    exe.run(program, scope=scope)
    exe.close()
    return Distributed(role, program, pserver_startup)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--sync`` (the default) / ``--async`` (dest ``async_mode``), ``--no-slice`` (dest
    ``slice_var_up``), ``--hybrid`` and ``--geo-sgd K`` (dest ``geo_sgd``) to ``parser``; they only matter in
    a distributed job."""
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--sync", dest="async_mode", action="store_false", default=False,
                      help="distributed: synchronous training, a barrier a step (the default)")
    mode.add_argument("--async", dest="async_mode", action="store_true", default=False,
                      help="distributed: asynchronous training, each gradient applied on arrival")
    parser.add_argument("--no-slice", dest="slice_var_up", action="store_false",
                        help="distributed: place each parameter whole on one pserver instead of slicing the "
                             "large ones over all pservers")
    parser.add_argument("--hybrid", action="store_true",
                        help="distributed: allreduce the dense gradients among the trainers and keep only the "
                             "distributed lookup table on the pservers")
    parser.add_argument("--geo-sgd", dest="geo_sgd", type=int, default=None, metavar="K",
                        help="distributed, with --async: Geo-SGD, each trainer optimizes locally (a distributed "
                             "table too) and syncs its parameters' change every K steps")


def distribute_from_args(main: ir.Program, startup: ir.Program, args: argparse.Namespace,
                         role: Role | None = None) -> Distributed:
    """``distribute`` with the options ``add_arguments`` parsed into ``args``."""
    geo = getattr(args, "geo_sgd", None)
    config = DistributeTranspilerConfig(slice_var_up=args.slice_var_up, geo_sgd_mode=geo is not None,
                                        geo_sgd_need_push_nums=100 if geo is None else geo,
                                        mode="hybrid" if getattr(args, "hybrid", False) else "pserver")
    return distribute(main, startup, sync_mode=not args.async_mode, config=config, role=role)


def forward_prefix(program: ir.Program) -> ir.Program:
    """A clone of ``program`` cut before its first global-block op with the BACKWARD role bit.

    On a transpiled trainer program this is the forward pass including a distributed table's
    ``split_ids → prefetch → merge_ids`` (which ``clone(for_test=True)`` would drop, as their roles are
    not forward), so it evaluates a model whose table the trainer does not hold. A program without
    backward ops is returned whole.
    """
    out = program.clone()
    block = out.global_block()
    cut = next((op.idx for op in block.ops if op.role & OpRole.BACKWARD), len(block.ops))
    for index in range(len(block.ops) - 1, cut - 1, -1):
        block.remove_op(index)
    return out
