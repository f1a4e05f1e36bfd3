"""Fluid 1.5's ``ParallelExecutor``: a ``runtime.Executor`` over a data-parallel ``CompiledProgram``.

It lives in the façade package because it joins the two sides: ``transpiler`` builds the data-parallel
program, ``runtime`` runs it (``transpiler`` never imports ``runtime``).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import runtime
from ir.core import Program, default_main_program
from runtime import collective
from transpiler.compiled_program import BuildStrategy, CompiledProgram, ExecutionStrategy
from transpiler.config import TranspilerError


class ParallelExecutor:
    """Fluid 1.5's ``ParallelExecutor``: an Executor over a data-parallel ``CompiledProgram``.

    With ``num_trainers > 1`` the program must come from an nccl2 transpile and the trainer startup
    program must have run (it joins the group); each process then drives one device."""

    def __init__(self, use_cuda: bool, loss_name: str | None = None, main_program: Program | None = None,
                 share_vars_from: Any = None, exec_strategy: ExecutionStrategy | None = None,
                 build_strategy: BuildStrategy | None = None, num_trainers: int = 1, trainer_id: int = 0,
                 scope: Any = None) -> None:
        if isinstance(num_trainers, bool) or not isinstance(num_trainers, int) or num_trainers < 1:
            raise TranspilerError(f"num_trainers must be an int >= 1, got {num_trainers!r}", code="E702")
        if isinstance(trainer_id, bool) or not isinstance(trainer_id, int) or not 0 <= trainer_id < num_trainers:
            raise TranspilerError(f"trainer_id {trainer_id!r} is out of range for {num_trainers} trainer(s)",
                                  code="E703")
        program = main_program if main_program is not None else default_main_program()
        if num_trainers > 1:
            group = collective.current_group()
            if group is None or group.nranks != num_trainers or group.trainer_id != trainer_id:
                raise TranspilerError(
                    f"ParallelExecutor(num_trainers={num_trainers}, trainer_id={trainer_id}) needs this process to "
                    "have joined that trainer group" + (f"; it is trainer {group.trainer_id} of {group.nranks}"
                                                        if group else ""),
                    hint="transpile with config.mode='nccl2' and run get_trainer_startup_program() first",
                    code="E703")
        self._exe = runtime.Executor(runtime.CUDAPlace(0) if use_cuda else runtime.CPUPlace())
        self._compiled = CompiledProgram(program, build_strategy).with_data_parallel(loss_name, build_strategy,
                                                                                     exec_strategy)
        self._scope = scope

    @property
    def device_count(self) -> int:
        return collective.device_mesh().nranks

    def run(self, fetch_list: Sequence[Any], feed: Mapping[str, Any] | None = None,
            feed_dict: Mapping[str, Any] | None = None, return_numpy: bool = True) -> list[Any]:
        """Fluid's signature: fetches first; ``feed_dict`` is the old name of ``feed``."""
        if feed is not None and feed_dict is not None:
            raise TranspilerError("give feed or feed_dict, not both", code="E712")
        return self._exe.run(self._compiled, feed=feed if feed is not None else feed_dict, fetch_list=fetch_list,
                             scope=self._scope, return_numpy=return_numpy)

    def close(self) -> None:
        self._exe.close()


__all__ = ["ParallelExecutor"]
