"""``flotilla.ray.launch``: run a Flotilla job on a Ray cluster from Python (what ``flotilla launch --ray``
does; see ``runtime.ray_launch``). Needs ``pip install 'flotilla[ray]'``; ray is imported only when a job
runs."""
from __future__ import annotations

from typing import Sequence

from runtime.launch import launch as _launch


def launch(address: str, script: str, script_args: Sequence[str] = (), *, server_num: int | None = None,
           worker_num: int | None = None, trainers: int | None = None, cpus_per_trainer: float = 1.0,
           gpus_per_trainer: float = 0.0, cpus_per_pserver: float = 1.0, stop_timeout: float = 60.0) -> int:
    """Run ``script`` on the Ray cluster at ``address``: ``server_num`` pservers and ``worker_num`` trainers
    (parameter-server mode), or ``trainers`` collective trainers; the launcher's exit status (0 success,
    1 a role failed, 2 a usage error). Output goes to stdout tagged ``[trainer.0] `` as with the CLI."""
    argv = ["--ray", address, "--cpus_per_trainer", str(cpus_per_trainer), "--gpus_per_trainer",
            str(gpus_per_trainer), "--cpus_per_pserver", str(cpus_per_pserver), "--stop_timeout", str(stop_timeout)]
    if trainers is not None:
        argv += ["--nproc_per_node", str(trainers)]
    if server_num is not None:
        argv += ["--server_num", str(server_num)]
    if worker_num is not None:
        argv += ["--worker_num", str(worker_num)]
    return _launch([*argv, script, *script_args], prog="flotilla.ray.launch")
