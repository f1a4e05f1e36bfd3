"""``runtime.shm_collective``: the shared-memory allreduce arena, rank processes against one arena.

The arena is exercised directly here (processes of this test, no JAX group); the trainer group uses it
through ``runtime.collective`` (``tests/runtime/collective`` trains through it, and ``xla`` against it).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np
import pytest

from runtime import shm_collective as shm

pytestmark = [pytest.mark.skipif(shm.unusable_reason([shm.host_identity()]) is not None,
                                 reason="no shared-memory arena on this machine"),
              pytest.mark.serial]  # ranks as processes, timed against each other

CTX = mp.get_context("spawn")  # a fresh interpreter a rank, as trainers are


def _rank(path: str, rank: int, nranks: int, script: list[tuple[str, Any]], out: Any, timeout_s: float) -> None:
    """Open the arena at ``path`` as ``rank`` and run ``script``: ("sum", (size, dtype, seed)) allreduces
    the rank's values; ("exit", code) leaves at once; ("sleep", s) waits. Results (or the error) go to
    ``out``."""
    fd = os.open(path, os.O_RDWR)
    arena = shm.Arena(fd, rank, nranks, timeout_s)
    os.close(fd)
    results: list[Any] = []
    try:
        for what, arg in script:
            if what == "exit":
                os._exit(arg)
            if what == "sleep":
                time.sleep(arg)
                continue
            size, dtype, seed = arg
            x = _values(size, dtype, seed, rank)
            results.append(arena.allreduce(x).copy())
    except shm.ShmAllreduceError as e:
        out.put((rank, "error", e.message, e.gone))
        return
    out.put((rank, "ok", results, []))


def _values(size: int, dtype: str, seed: int, rank: int) -> np.ndarray:
    rng = np.random.default_rng(seed * 100 + rank)
    return (rng.standard_normal(size) * 10).astype(dtype) if dtype.startswith("float") else \
        rng.integers(-1000, 1000, size).astype(dtype)


def run_ranks(nranks: int, scripts: list[list[tuple[str, Any]]], chunk: int = shm.MAX_CHUNK,
              timeout_s: float = 20.0) -> dict[int, tuple[str, Any, list[int]]]:
    fd, path = shm.create(nranks, chunk)
    os.close(fd)
    out = CTX.Queue()
    procs = [CTX.Process(target=_rank, args=(path, r, nranks, scripts[r], out, timeout_s)) for r in range(nranks)]
    try:
        for p in procs:
            p.start()
        results: dict[int, tuple[str, Any, list[int]]] = {}
        expected = sum(1 for s in scripts if not any(w == "exit" for w, _ in s))
        deadline = time.monotonic() + 60
        while len(results) < expected and time.monotonic() < deadline:
            try:
                rank, status, value, gone = out.get(timeout=1)
            except Exception:  # noqa: BLE001 - queue.Empty: poll again until the deadline
                continue
            results[rank] = (status, value, gone)
        assert len(results) == expected, f"ranks answered: {sorted(results)}"
        return results
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        os.unlink(path)


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_sums_equal_numpys_over_chunks_dtypes_and_odd_sizes(nranks: int) -> None:
    calls = [(1, "float32", 1), (1000, "float32", 2), (70_001, "float32", 3), (5000, "float64", 4),
             (3, "int32", 5), (40_000, "float32", 6)]
    # A 64 KiB slot: 70,001 float32 values take 5 chunks, 40,000 take 3; sizes below nranks leave ranks
    # without a share of the reduction.
    results = run_ranks(nranks, [[("sum", c) for c in calls]] * nranks, chunk=64 << 10)
    for rank in range(nranks):
        status, got, _ = results[rank]
        assert status == "ok", got
        for (size, dtype, seed), value in zip(calls, got):
            want = sum(_values(size, dtype, seed, r).astype(np.float64) for r in range(nranks))
            assert value.dtype == np.dtype(dtype) and value.shape == (size,)
            np.testing.assert_allclose(value, want, rtol=1e-5 if dtype == "float32" else 1e-12, atol=1e-3)
        # Every rank holds the very same sum (the reduction order does not depend on the rank).
        for value, first in zip(got, results[0][1]):
            np.testing.assert_array_equal(value, first)


def test_ranks_calling_with_other_sizes_all_fail_naming_the_call() -> None:
    results = run_ranks(2, [[("sum", (100, "float32", 1))], [("sum", (200, "float32", 1))]])
    for rank in (0, 1):
        status, message, _ = results[rank]
        assert status == "error"
        assert "allreduce call 1 of 800 bytes" in message or "allreduce call 1 of 400 bytes" in message, message


def test_a_rank_whose_process_is_gone_is_named_within_a_second() -> None:
    start = time.monotonic()
    results = run_ranks(3, [[("sum", (1000, "float32", 1))] * 3,
                            [("sum", (1000, "float32", 1)), ("exit", 3)],
                            [("sum", (1000, "float32", 1))] * 3], timeout_s=30.0)
    assert time.monotonic() - start < 15
    for rank in (0, 2):
        status, message, gone = results[rank]
        assert status == "error" and gone == [1], (status, message)
        assert "trainer(s) [1] left the group" in message


def test_a_rank_that_does_not_come_times_out_naming_it() -> None:
    results = run_ranks(2, [[("sum", (10, "float32", 1))], [("sleep", 3.0), ("sum", (10, "float32", 1))]],
                        timeout_s=0.5)
    status, message, gone = results[0]
    assert status == "error" and gone == []
    assert "trainer(s) [1] did not reach the shared-memory allreduce within" in message
    assert results[1][0] == "error"  # the late rank finds the arena broken (rank 0 left it mid-call)


def test_a_failed_arena_refuses_every_later_call() -> None:
    fd, path = shm.create(2, 1 << 20)
    try:
        arena = shm.Arena(fd, 0, 2, 0.2)
    finally:
        os.close(fd)
        os.unlink(path)
    with pytest.raises(shm.ShmAllreduceError, match="did not reach"):
        arena.allreduce(np.ones(4, np.float32))
    with pytest.raises(shm.ShmAllreduceError, match="failed earlier"):
        arena.allreduce(np.ones(4, np.float32))
    arena.close()


def test_the_arena_file_is_private_and_its_header_checked() -> None:
    fd, path = shm.create(2, 1 << 20)
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert os.path.basename(path).startswith(shm.PREFIX)
        with pytest.raises(shm.ShmAllreduceError, match="header does not match"):
            shm.Arena(fd, 0, 3, 1.0)  # made for 2 ranks
    finally:
        os.close(fd)
        os.unlink(path)


def test_hosts_differ_by_boot_namespace_or_machine() -> None:
    me = shm.host_identity()
    assert shm.unusable_reason([me, dict(me)]) is None
    assert "trainer 1 runs on another host" in shm.unusable_reason([me, {**me, "netns": [0, 1]}])
    assert "its boot differ" in shm.unusable_reason([me, me, {**me, "boot": "other"}])
    assert "not x86-64" in shm.unusable_reason([{**me, "machine": "aarch64"}] * 2)


def test_the_flag_is_checked() -> None:
    assert shm.choice({}) == "auto"
    assert shm.choice({shm.FLAG: "XLA"}) == "xla"
    with pytest.raises(shm.ShmAllreduceError, match="FLAGS_cpu_allreduce='gloo' is not one of auto, shm, xla"):
        shm.choice({shm.FLAG: "gloo"})
