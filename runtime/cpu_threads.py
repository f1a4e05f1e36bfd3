"""XLA CPU threads of the job's processes that share one host's cores.

XLA's CPU client sizes its thread pools once, when it is made, from ``PJRT_NPROC`` (every CPU by
default). Several processes of one job on one host (co-located trainers, or a parameter server beside its
trainers), each sized to every CPU, oversubscribe the cores: their threads spin and hand off work, and
that costs CPU the job could have used. Measured here (2 cores): 2 collective Transformer trainers used
~15% less CPU per example with 1 thread each; a 1-pserver x 2-trainer CTR job's trainers ~9% less CPU a
step. torchrun does the same for torch (``OMP_NUM_THREADS=1`` for several processes a node).

The rule (``xla_threads``), from ``FLAGS_cpu_threads_per_trainer``: ``auto`` (the default) divides the
CPUs a process may run on by the job's processes on its host (at least 1 each); N gives N; ``0`` leaves
XLA's default. A ``PJRT_NPROC`` or ``NPROC`` the user set always wins. Who applies it: ``flotilla launch``
in each process's environment (it knows every process of the job on its host), and a collective trainer
when it joins its group (``runtime.collective``: counted from the trainer endpoints on its host), before
JAX's CPU client exists. This module imports no JAX: the launcher uses it.
"""
from __future__ import annotations

import os
from typing import Mapping

from ir.errors import FlotillaError

THREADS_ENV = "FLAGS_cpu_threads_per_trainer"  # auto (CPUs / the job's processes here), N, or 0 (XLA's default)
XLA_NPROC_ENVS = ("PJRT_NPROC", "NPROC")  # what XLA's CPU client sizes its thread pools by (PJRT_NPROC first)


class CPUThreadsError(FlotillaError):
    """``FLAGS_cpu_threads_per_trainer`` holds something other than ``auto`` or a thread count."""

    code = "E653"


def xla_threads(local_processes: int, cpus: int, environ: Mapping[str, str] | None = None) -> int | None:
    """XLA CPU threads for one of ``local_processes`` processes of a job sharing ``cpus`` CPUs, by the rule
    above; None: leave XLA alone (the flag is ``0``, or the user set ``PJRT_NPROC``/``NPROC``)."""
    env = os.environ if environ is None else environ
    raw = env.get(THREADS_ENV, "auto").strip().lower() or "auto"
    count: int | None = None
    if raw != "auto":
        try:
            count = int(raw)
        except ValueError:
            count = -1
        if count < 0:
            raise CPUThreadsError(f"{THREADS_ENV}={raw!r} is neither 'auto' nor a number of threads >= 0",
                                  hint=f"{THREADS_ENV}=auto splits this host's CPUs over the job's processes on "
                                       "it; 0 keeps XLA's default (every CPU for each process)")
    if count == 0 or any(env.get(name, "").strip() for name in XLA_NPROC_ENVS):
        return None
    if count is not None:
        return count
    return max(1, cpus // max(1, local_processes))


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which a container or taskset narrows)."""
    return len(os.sched_getaffinity(0))
