"""Program → Program rewrites (one pass a module) and the pass manager.

``default_pipeline()`` is the parameter-server pipeline the DistributeTranspiler runs.
"""
from __future__ import annotations

from passes.collect_params import CollectParams
from passes.distributed_table import DistributedTable
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


__all__ = [
    "CollectParams", "DistributedTable", "Pass", "PassContext", "PassError", "PassManager", "PlaceBlocks",
    "PserverProgram", "PserverStartup", "SliceVariables", "TrainerSendRecv", "TrainerStartup",
    "default_pipeline", "slice_variable",
]
