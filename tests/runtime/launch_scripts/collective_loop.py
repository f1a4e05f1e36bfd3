"""A collective trainer for the multi-host launcher tests: joins the group from Paddle's environment (as
``flotilla launch`` sets it), prints ``joined``, then all-gathers a value every 0.1 s until one rank's
``--seconds`` (default 60) have passed (every rank stops after the same gather). With ``--report-sockets``
it prints ``listening HOST:PORT`` for each socket it listens on, once, after the first gather (gloo's
connections are made by then); nothing runs between the last gather and exit.
A peer that vanishes fails the gather; the error then names the lost endpoints
(``runtime.collective.describe_failure``) and the process exits 1."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from runtime import collective
from runtime.role import role_from_env


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--report-sockets", action="store_true", dest="report_sockets")
    opts = parser.parse_args()
    role = role_from_env()
    collective.join_group(role.trainer_id, role.trainer_endpoints)
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    print(f"joined trainer {role.trainer_id} of {role.trainers}", flush=True)
    deadline = time.monotonic() + opts.seconds
    first = True
    while True:
        # Every rank stops after the same gather: the one in which any rank's own deadline had passed. (Each
        # rank counting its own time would leave them a different number of collectives apart, and hang.)
        expired = float(time.monotonic() >= deadline)
        try:
            gathered = multihost_utils.process_allgather(jnp.array([float(role.trainer_id), expired]))
        except Exception as e:  # noqa: BLE001 - a peer left: name it
            print(f"error: {collective.describe_failure(e)}", file=sys.stderr, flush=True)
            os._exit(1)
        if first and opts.report_sockets:
            _report_listening()  # a slow report only makes the peer wait at the next gather
        first = False
        if gathered[:, 1].any():
            return 0
        time.sleep(0.1)


def _report_listening() -> None:
    """One ``listening HOST:PORT`` line per TCP socket this process listens on (``ss -tlnpH``)."""
    out = subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True, timeout=10).stdout
    for line in out.splitlines():
        if f"pid={os.getpid()}," in line:
            print(f"listening {line.split()[3]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
