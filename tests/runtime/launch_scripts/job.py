"""A tiny "training script" for the launcher tests: it reports its role and then behaves as told.

Every line it prints is machine-readable (``key=value``) so the tests can check what each process saw:
``pid=``, one ``env NAME=VALUE`` per role variable, ``role ...`` (what ``role_from_env`` made of them),
``args=`` (its own arguments, JSON). One line goes to stderr, to check that stderr is captured too.

Options: ``--pserver exit|hang`` (a pserver exits 0 after a moment, or sleeps until it is killed, at
most 120 s); ``--fail-trainer K`` (trainer K prints a last line and exits 1); ``--trainer-sleep S``.

``runtime/role.py`` is loaded from its file rather than through the ``runtime`` package, whose import
pulls in jax (about a second of start-up per process); role.py itself needs only ``ir.errors``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import sys
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

ROLE_FILE = REPO_ROOT / "runtime" / "role.py"


def _load_role_module() -> object:
    spec = importlib.util.spec_from_file_location("_launch_test_role", ROLE_FILE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {ROLE_FILE}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pserver", choices=("exit", "hang"), default="exit")
    parser.add_argument("--fail-trainer", type=int, default=None, dest="fail_trainer")
    parser.add_argument("--trainer-sleep", type=float, default=0.0, dest="trainer_sleep")
    opts, _ = parser.parse_known_args()  # other arguments are only echoed back

    role_module = _load_role_module()
    role = role_module.role_from_env()  # type: ignore[attr-defined]
    print(f"pid={os.getpid()}")
    for name in (*role_module.ROLE_ENV_VARS, "PYTHONUNBUFFERED"):  # type: ignore[attr-defined]
        print(f"env {name}={os.environ.get(name, '<unset>')}")
    print(f"role role={role.role} trainer_id={role.trainer_id} trainers={role.trainers} "
          f"current={role.current_endpoint} pservers={role.pservers} pserver_index={role.pserver_index}")
    print(f"args={json.dumps(sys.argv[1:])}")
    print(f"stderr line from {role.role.lower()}", file=sys.stderr)
    if role.is_pserver:
        if opts.pserver == "hang":
            print("pserver hanging", flush=True)
            time.sleep(120)
        else:
            time.sleep(0.2)
        return 0
    time.sleep(opts.trainer_sleep)
    if opts.fail_trainer == role.trainer_id:
        print(f"trainer {role.trainer_id} fails now")
        return 1
    print(f"trainer {role.trainer_id} done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
