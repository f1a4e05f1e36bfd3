"""Program → Program rewrites (one pass a module) and the pass manager.

``default_pipeline()`` is the parameter-server pipeline the DistributeTranspiler runs;
``collective_pipeline(kind)`` the nccl2/collective one; ``hybrid_pipeline()`` composes the two for hybrid
mode (the distributed table through the pserver passes, the dense gradients through the collective ones).
"""
from __future__ import annotations

from passes.collect_params import CollectParams
from passes.collective_plan import GRAD_ALLREDUCE, LOCAL_SGD, CollectivePlan
from passes.collective_startup import CollectiveStartup
from passes.distributed_table import DistributedTable
from passes.dgc import DGC
from passes.grad_allreduce import GradAllReduce
from passes.local_sgd import LocalSGD
from passes.memory_optimize import MemoryOptimize
from passes.release_memory import ReleaseMemory
from passes.pass_base import Pass, PassContext, PassError, PassManager
from passes.place_blocks import PlaceBlocks
from passes.pserver_program import PserverProgram
from passes.pserver_startup import PserverStartup
from passes.slice_variables import SliceVariables, slice_variable
from passes.trainer_send_recv import TrainerSendRecv
from passes.trainer_startup import TrainerStartup


def default_pipeline() -> list[Pass]:
    return [CollectParams(), SliceVariables(), PlaceBlocks(), TrainerSendRecv(), TrainerStartup(),
            PserverProgram(), PserverStartup(), DistributedTable()]


def collective_pipeline(kind: str = GRAD_ALLREDUCE) -> list[Pass]:
    """The nccl2/collective pipeline: join the group in the startup program, ready DGC's exchange (``dgc``,
    a no-op without DGC), then average gradients (``grad_allreduce``) or parameters (``local_sgd``)."""
    if kind not in (GRAD_ALLREDUCE, LOCAL_SGD):
        raise PassError(f"collective kind {kind!r} is unknown; expected {GRAD_ALLREDUCE!r} or {LOCAL_SGD!r}")
    return [CollectiveStartup(), DGC(), GradAllReduce() if kind == GRAD_ALLREDUCE else LocalSGD()]


def hybrid_pipeline() -> list[Pass]:
    """Hybrid mode: the pserver pipeline over a plan marked ``hybrid`` (it moves only the distributed table
    to the pservers), then the collective pipeline over what stays on the trainer (the dense gradients; the
    table's optimize ops have left, so ``grad_allreduce`` never reduces its gradient). There is no
    ``trainer_startup``: no dense parameter comes from a pserver (``collective_startup`` broadcasts trainer
    0's), and the table never lives on the trainer."""
    pserver = [p for p in default_pipeline() if not isinstance(p, TrainerStartup)]
    return pserver + collective_pipeline(GRAD_ALLREDUCE)


__all__ = [
    "CollectParams", "CollectivePlan", "CollectiveStartup", "DGC", "GradAllReduce", "LocalSGD", "MemoryOptimize", "ReleaseMemory", "collective_pipeline", "hybrid_pipeline", "DistributedTable", "Pass", "PassContext", "PassError", "PassManager", "PlaceBlocks",
    "PserverProgram", "PserverStartup", "SliceVariables", "TrainerSendRecv", "TrainerStartup",
    "default_pipeline", "slice_variable",
]
