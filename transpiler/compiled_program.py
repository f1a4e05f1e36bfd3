"""Fluid's data-parallel programs: ``CompiledProgram(...).with_data_parallel(...)``, over every device of this
process (and of every trainer process in an nccl2 job); ``ParallelExecutor`` over it is in
``flotilla.parallel_executor`` (it needs the runtime, which this package never imports).

``CompiledProgram(main).with_data_parallel(loss_name=...)`` marks a program for data-parallel runs: an
``Executor`` given it splits each fed batch over the devices (``XLA_FLAGS=--xla_force_host_platform_
device_count=N`` on CPU, every visible GPU with ``CUDAPlace``), keeps one copy of the parameters a device,
and averages the gradients with the ``grad_allreduce`` pass (one allreduce a bucket, inside the
compiled step) before the optimizer. A program already transpiled in nccl2 mode is run as it is, one
device a trainer process. Fetched values are concatenated over this process's devices along dim 0 (a
loss of shape [1] comes back with one entry a device), as in Fluid; parameters come back once.

Invariants: the user's program is never modified (the rewrite works on a clone, cached per group size);
nothing here imports the runtime: ``runtime.Executor`` resolves the mesh a CompiledProgram asks for.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ir.core import Program
from ir.data_parallel import DataParallelRun, DataParallelSource
from ir.ops import op_has_trait
from ir.program_set import ProgramRole, ProgramSet

from passes.collective_plan import CollectivePlan
from passes.dgc import DGC, has_dgc
from passes.grad_allreduce import GradAllReduce
from passes.pass_base import PassContext, PassManager
from passes.dist_plan import DistPlan
from transpiler.config import TranspilerError


@dataclass
class BuildStrategy:
    """Fluid's build options that matter here: ``fuse_all_reduce_ops`` (buckets of
    ``fuse_grad_size_in_MB``); the others are accepted for compatibility and have no effect (XLA fuses)."""

    fuse_all_reduce_ops: bool = True
    fuse_grad_size_in_MB: float = 32.0
    reduce_strategy: Any = None
    gradient_scale_strategy: Any = None
    enable_inplace: bool = True
    memory_optimize: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ExecutionStrategy:
    """Accepted for Fluid compatibility (thread counts mean nothing to XLA)."""

    num_threads: int = 0
    num_iteration_per_drop_scope: int = 1
    allow_op_delay: bool = False


def is_collective_program(program: Program) -> bool:
    """Whether ``program`` already reduces its gradients (transpiled in nccl2/collective mode)."""
    return any(op_has_trait(op.type, "replica_reduce") for b in program.blocks for op in b.ops)


def data_parallel_program(program: Program, nranks: int, fuse_grad_size_mb: float = 32.0) -> Program:
    """A clone of ``program`` whose gradients are averaged over ``nranks`` devices (``grad_allreduce``).
    DGC over several devices of one process is refused (E775): its accumulators are each trainer's own,
    and the devices of one process share one copy of every persistable variable."""
    if nranks > 1 and has_dgc(program):
        raise TranspilerError(f"DGCMomentumOptimizer cannot run data parallel over {nranks} devices of one process: "
                              "its U and V accumulators are per-trainer state, and the devices of one process "
                              "share one copy of each persistable variable",
                              hint="run one trainer process per device (transpile in nccl2 mode and launch with "
                                   "flotilla launch), or use MomentumOptimizer", code="E775")
    plan = CollectivePlan(trainer_id=0, endpoints=tuple(f"device:{i}" for i in range(nranks)),
                          fuse_grad_size_mb=fuse_grad_size_mb)
    programs = ProgramSet()
    programs.add(ProgramRole.trainer(0), program.clone(), Program())
    ctx = PassContext(origin_main=program, origin_startup=Program(),
                      plan=DistPlan(trainer_id=0, trainers=nranks, sync_mode=True, pservers=()), collective=plan)
    PassManager([DGC(), GradAllReduce()]).run(programs, ctx)  # DGC: nranks 1 only (see above)
    return programs[ProgramRole.trainer(0)].main


class CompiledProgram(DataParallelSource):
    """``CompiledProgram(program)``; ``.with_data_parallel(...)`` makes Executor runs data parallel."""

    def __init__(self, program_or_graph: Program, build_strategy: BuildStrategy | None = None) -> None:
        if not isinstance(program_or_graph, Program):
            raise TranspilerError(f"CompiledProgram needs an ir.Program, got {type(program_or_graph).__name__}",
                                  code="E712")
        self._program = program_or_graph
        self._build_strategy = build_strategy or BuildStrategy()
        self._data_parallel = False
        self._loss_name: str | None = None
        self._rewritten: dict[tuple[int, int], Program] = {}

    def with_data_parallel(self, loss_name: str | None = None, build_strategy: BuildStrategy | None = None,
                           exec_strategy: ExecutionStrategy | None = None, share_vars_from: Any = None,
                           places: Sequence[Any] | None = None) -> "CompiledProgram":
        """Run data parallel over every device (``places`` is accepted; the devices are JAX's)."""
        if loss_name is not None and not isinstance(loss_name, str):
            loss_name = getattr(loss_name, "name", None)
            if loss_name is None:
                raise TranspilerError("loss_name must be a variable name or a Variable", code="E712")
        if loss_name is not None and self._program.global_block().find_var_recursive(loss_name) is None:
            raise TranspilerError(f"loss_name {loss_name!r} is not a variable of the program",
                                  hint="pass the name of the loss variable (loss.name)", code="E712")
        if build_strategy is not None:
            self._build_strategy = build_strategy
        self._data_parallel = True
        self._loss_name = loss_name
        return self

    @property
    def program(self) -> Program:
        return self._program

    def program_for(self, nranks: int) -> Program:
        """The program a mesh of ``nranks`` devices runs (the input itself when already collective)."""
        if is_collective_program(self._program):
            return self._program
        key = (nranks, self._program.version)
        cached = self._rewritten.get(key)
        if cached is None:
            bs = self._build_strategy
            cached = data_parallel_program(self._program, nranks,
                                           bs.fuse_grad_size_in_MB if bs.fuse_all_reduce_ops else 0.0)
            self._rewritten = {key: cached}  # older versions of the program are dead
        return cached

    def data_parallel_run(self) -> DataParallelRun:
        """For ``runtime.Executor``, which resolves the mesh (this module never imports the runtime): an
        nccl2-transpiled program wants one device a trainer process, any other every local device."""
        if not self._data_parallel:
            return DataParallelRun(self._program, None, None)
        return DataParallelRun(self._program, "process" if is_collective_program(self._program) else "devices",
                               self.program_for)


__all__ = ["BuildStrategy", "CompiledProgram", "ExecutionStrategy", "data_parallel_program", "is_collective_program"]
