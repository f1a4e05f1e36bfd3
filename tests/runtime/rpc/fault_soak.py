"""A fault soak of a 2 x 2 sync job (``tests.runtime.rpc.ps_worker``, real processes on 127.0.0.1).

``python -m tests.runtime.rpc.fault_soak [--runs N] [--seed S] [--steps K] [--run-timeout T] [--out DIR]``

Each run draws one fault from a fixed seed and injects it into a fresh job: a trainer SIGKILLed, a
trainer SIGSTOPped, a trainer killed and restarted with the same id (it resumes where the pservers admit
it), a pserver SIGKILLed, or forged requests from a process outside the job (Complete for every trainer,
a send with a huge sequence number). Every run must end within ``--run-timeout`` seconds in one of two
acceptable ways:

- ``correct``: every process exited 0 and the parameters equal single-process training on exactly the
  batches the trainers sent (rtol 1e-9, float64);
- ``named``: the job failed and the logs name the party at fault (the trainer id, or the pserver's
  endpoint).

Anything else counts against the runtime: ``wrong`` (exit 0 with other parameters: a silent wrong
result), ``unnamed`` (failed without naming the party) or ``timeout``. The counts are printed as one JSON
line; the exit status is 1 when any run was not acceptable. Every process is started here and killed by
pid; a stopped process is killed too.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import signal
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

FAULTS = ("kill-trainer", "stop-trainer", "restart-trainer", "kill-pserver", "forge")


def _wait_line(c: Any, tag: str, text: str, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if text in c.log(tag):
            return True
        if c.procs[tag].poll() is not None:
            return False
        time.sleep(0.05)
    return False


def _wait_exit(c: Any, timeout: float) -> dict[str, int] | None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(p.poll() is not None for p in c.procs.values()):
            return {tag: p.returncode for tag, p in c.procs.items()}
        time.sleep(0.05)
    return None


def _params_match(out: pathlib.Path, steps: int, present: Callable[[int, int], bool], restarted: int | None) -> bool:
    from tests.runtime.rpc.test_ps_training import local_reference, trained

    # a restarted trainer saved the parameters it joined with as its "initial" ones: use the other's
    init = dict(np.load(out / f"trainer_{1 if restarted == 0 else 0}_init.npz"))
    final = trained(out, "fc", 2)
    expected = local_reference("fc", "sgd", "const", init, 2, range(steps), present=present)
    return all(np.allclose(final[n], v, rtol=1e-9, atol=1e-12) for n, v in expected.items())


def one_run(fault: str, rng: random.Random, out: pathlib.Path, steps: int, timeout: float) -> tuple[str, str]:
    """Inject ``fault`` into a fresh 2 x 2 job; (outcome, detail)."""
    from tests.runtime.rpc.test_ps_training import AUTHENTICATED, Cluster, _forge

    victim = rng.randrange(2)
    at = rng.randrange(2, steps - 3)
    env = {"FLAGS_pserver_timeout_ms": "5000", "FLAGS_rpc_deadline": "20000", **AUTHENTICATED}  # restarts rejoin
    trainer_args: dict[int, list[str]] = {}
    if fault == "restart-trainer":
        trainer_args[victim] = ["--die-at", str(at)]
    c = Cluster(out, 2, 2, ["--steps", str(steps), "--sleep", "0.05"], env=env, trainer_args=trainer_args)
    start = time.monotonic()
    stopped = None
    try:
        present: Callable[[int, int], bool] = lambda t, s: True  # noqa: E731
        party = ""
        if fault in ("kill-trainer", "stop-trainer"):
            party = f"trainer(s) [{victim}]"
            if _wait_line(c, f"trainer.{victim}", f"step {at}", timeout):
                proc = c.procs[f"trainer.{victim}"]
                if fault == "kill-trainer":
                    proc.send_signal(signal.SIGKILL)
                else:
                    proc.send_signal(signal.SIGSTOP)
                    stopped = proc
        elif fault == "kill-pserver":
            index = victim
            party = c.endpoints[index]
            if _wait_line(c, "trainer.0", f"step {at}", timeout):
                c.procs[f"pserver.{index}"].send_signal(signal.SIGKILL)
        elif fault == "forge":
            if _wait_line(c, "trainer.0", f"step {at}", timeout):
                _forge(c.endpoints, None)
        elif fault == "restart-trainer":
            tag = f"trainer.{victim}"
            proc = c.procs[tag]
            try:
                proc.wait(timeout=timeout)
            except Exception:  # noqa: BLE001 - reported as a timeout below
                pass
            if proc.poll() is not None:
                c.restart_trainer(victim, ["--steps", str(steps), "--resume"])
        remaining = timeout - (time.monotonic() - start)
        codes = _wait_exit(c, remaining) if fault != "stop-trainer" else None
        if fault == "stop-trainer":
            # the stopped trainer never exits by itself: wait for the others
            others = [p for tag, p in c.procs.items() if tag != f"trainer.{victim}"]
            end = start + timeout
            while time.monotonic() < end and any(p.poll() is None for p in others):
                time.sleep(0.05)
            if any(p.poll() is None for p in others):
                return "timeout", "the healthy processes did not end"
            codes = {tag: p.poll() for tag, p in c.procs.items()}
        if codes is None:
            return "timeout", f"not over after {timeout:g}s"
        logs = c.logs()
        if fault == "restart-trainer":
            joined = [line for line in c.log(f"trainer.{victim}.restarted").splitlines() if "resumes at step" in line]
            if not joined:  # the restarted process did not get in: the job must fail naming the trainer
                party = f"trainer(s) [{victim}]"
                return (("named", "the restarted trainer did not join") if party in logs
                        else ("unnamed", f"{party} not in logs\n{logs[-1500:]}"))
            j = int(joined[0].rsplit(" ", 1)[1])
            present = lambda t, s: t != victim or s < at or s >= j  # noqa: E731
        if all(code == 0 for tag, code in codes.items()):
            if fault in ("kill-trainer", "stop-trainer", "kill-pserver"):
                return "wrong", "the job succeeded although a party was lost"
            restarted = victim if fault == "restart-trainer" else None
            return (("correct", "") if _params_match(out, steps, present, restarted)
                    else ("wrong", "parameters differ"))
        if fault in ("forge", "restart-trainer"):
            return "unnamed", f"the job failed: {codes}\n{logs[-1500:]}"
        return ("named", party) if party in logs else ("unnamed", f"{party} not in logs\n{logs[-1500:]}")
    finally:
        if stopped is not None and stopped.poll() is None:
            stopped.kill()
        c.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="fault soak of a 2x2 sync parameter-server job")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--run-timeout", type=float, default=90.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    base = pathlib.Path(args.out or tempfile.mkdtemp(prefix="fault_soak_"))
    counts: dict[str, int] = {}
    by_fault: dict[str, dict[str, int]] = {}
    bad = []
    for i in range(args.runs):
        fault = FAULTS[i % len(FAULTS)] if i < len(FAULTS) else rng.choice(FAULTS)
        out = base / f"run{i}"
        out.mkdir(parents=True)
        t0 = time.monotonic()
        outcome, detail = one_run(fault, rng, out, args.steps, args.run_timeout)
        counts[outcome] = counts.get(outcome, 0) + 1
        by_fault.setdefault(fault, {}).setdefault(outcome, 0)
        by_fault[fault][outcome] += 1
        print(f"run {i}: {fault}: {outcome} in {time.monotonic() - t0:.1f}s {detail.splitlines()[0] if detail else ''}",
              flush=True)
        if outcome not in ("correct", "named"):
            bad.append((i, fault, outcome, detail))
    for i, fault, outcome, detail in bad:
        print(f"--- run {i} ({fault}) {outcome}:\n{detail}", file=sys.stderr)
    print(json.dumps({"runs": args.runs, "seed": args.seed, "outcomes": counts, "by_fault": by_fault}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
