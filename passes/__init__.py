"""Program → Program rewrites (one pass a module) and the pass manager.

``default_pipeline()`` is the parameter-server pipeline the DistributeTranspiler runs;
``collective_pipeline(kind)`` the nccl2/collective one.
"""
from __future__ import annotations

from passes.collect_params import CollectParams
from passes.collective_plan import GRAD_ALLREDUCE, LOCAL_SGD, CollectivePlan
from passes.collective_startup import CollectiveStartup
from passes.distributed_table import DistributedTable
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
    """The nccl2/collective pipeline: join the group in the startup program, then average gradients
    (``grad_allreduce``) or parameters (``local_sgd``)."""
    if kind not in (GRAD_ALLREDUCE, LOCAL_SGD):
        raise PassError(f"collective kind {kind!r} is unknown; expected {GRAD_ALLREDUCE!r} or {LOCAL_SGD!r}")
    return [CollectiveStartup(), GradAllReduce() if kind == GRAD_ALLREDUCE else LocalSGD()]


__all__ = [
    "CollectParams", "CollectivePlan", "CollectiveStartup", "GradAllReduce", "LocalSGD", "MemoryOptimize", "ReleaseMemory", "collective_pipeline", "DistributedTable", "Pass", "PassContext", "PassError", "PassManager", "PlaceBlocks",
    "PserverProgram", "PserverStartup", "SliceVariables", "TrainerSendRecv", "TrainerStartup",
    "default_pipeline", "slice_variable",
]
