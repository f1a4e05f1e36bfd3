"""Shared pytest setup: the ``--update-goldens`` option, the ``golden`` fixture, one JAX compilation cache
and one Python bytecode cache for the session, and ``netns_hosts`` (hosts as network namespaces,
``tests/netns.py``).

The compilation cache: the suite starts hundreds of processes (pservers, trainers, launched scripts) that
compile the same few programs; each used to compile them again. A persistent cache in a directory made
for this session (``JAX_COMPILATION_CACHE_DIR``, inherited by every child process) lets the second
process load what the first compiled: the same executable, so results are unchanged (the bit-identical
tests still compare runs). The directory starts empty and is removed at the end of the session, so no
run sees another's cache. It needs ``filelock`` (a test dependency): with a size limit set, jax locks the
directory, so a process never reads an entry another is still writing. Without ``filelock``, or when
``JAX_COMPILATION_CACHE_DIR`` is already set, nothing is changed.

The bytecode cache: where ``PYTHONDONTWRITEBYTECODE`` is set (so that no ``__pycache__`` litters the
tree), every one of those processes compiled each of the project's modules from source again, about 0.2 s
of CPU a process. For the session, child processes instead write and read bytecode under a directory made
for it (``PYTHONPYCACHEPREFIX``; the source tree stays clean), removed at the end like the JAX cache. The
bytecode is what the interpreter would compile from the same sources, so nothing a test checks changes.
Where ``PYTHONDONTWRITEBYTECODE`` is unset (Python caches bytecode anyway) or ``PYTHONPYCACHEPREFIX`` is
already set, nothing is changed.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import sys
import tempfile
from typing import TYPE_CHECKING, Callable, Iterator

import pytest

if TYPE_CHECKING:
    from tests.netns import Hosts

_CACHE_DIR: str | None = None
_CACHE_ENV = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # the default (1 s) would skip most of our programs
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    "JAX_COMPILATION_CACHE_MAX_SIZE": str(4 << 30),  # any limit turns on jax's file lock; this one never evicts
}


def _start_compilation_cache() -> None:
    global _CACHE_DIR
    if "JAX_COMPILATION_CACHE_DIR" in os.environ or importlib.util.find_spec("filelock") is None:
        return
    _CACHE_DIR = tempfile.mkdtemp(prefix="flotilla-tests-jax-cache-")
    os.environ.update(_CACHE_ENV, JAX_COMPILATION_CACHE_DIR=_CACHE_DIR)
    if "jax" in sys.modules:  # imported before this conftest: its config read the environment already
        import jax

        jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        jax.config.update("jax_compilation_cache_max_size", 4 << 30)


_start_compilation_cache()

_PYCACHE_DIR: str | None = None


def _start_bytecode_cache() -> None:
    global _PYCACHE_DIR
    if not os.environ.get("PYTHONDONTWRITEBYTECODE") or "PYTHONPYCACHEPREFIX" in os.environ:
        return
    _PYCACHE_DIR = tempfile.mkdtemp(prefix="flotilla-tests-pycache-")
    del os.environ["PYTHONDONTWRITEBYTECODE"]  # children only: this process keeps its own setting
    os.environ["PYTHONPYCACHEPREFIX"] = _PYCACHE_DIR


_start_bytecode_cache()


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in (_CACHE_DIR, _PYCACHE_DIR):
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-goldens", action="store_true", default=False,
                     help="rewrite golden files with the current output instead of comparing")


class Golden:
    """Compares text with a golden file under the test module's ``goldens/`` folder."""

    def __init__(self, folder: pathlib.Path, update: bool) -> None:
        self.folder = folder
        self.update = update

    def check(self, name: str, text: str) -> None:
        path = self.folder / name
        if self.update or not path.exists():
            if not self.update:
                pytest.fail(f"golden file {path} is missing; run pytest --update-goldens and review the diff")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return
        expected = path.read_text()
        assert text == expected, f"output differs from golden {path}; if intended, run pytest --update-goldens"


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> Golden:
    folder = pathlib.Path(request.fspath).parent / "goldens"
    return Golden(folder, request.config.getoption("--update-goldens"))


@pytest.fixture
def netns_hosts() -> Iterator[Callable[..., "Hosts"]]:
    """A factory of namespaced hosts (``tests.netns.Hosts.create(n, resolve_hostname=True)``); every cluster
    made is closed at teardown (processes killed, namespaces deleted), pass or fail. Skips, with the
    reason, where network namespaces cannot be made."""
    from tests.netns import Hosts, NetnsUnavailable

    made: list[Hosts] = []

    def make(n: int, resolve_hostname: bool = True) -> Hosts:
        try:
            hosts = Hosts.create(n, resolve_hostname=resolve_hostname)
        except NetnsUnavailable as e:
            pytest.skip(str(e))
        made.append(hosts)
        return hosts

    try:
        yield make
    finally:
        for hosts in made:
            hosts.close()
