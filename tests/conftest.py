"""Shared pytest setup: the ``--update-goldens`` option, the ``golden`` fixture, one JAX compilation cache
and one Python bytecode cache for the session, ``netns_hosts`` (hosts as network namespaces,
``tests/netns.py``), and the ``serial`` tests' place under pytest-xdist.

Two workers: setup.cfg's addopts run the suite on two pytest-xdist workers (``--numprocesses=2
--dist=loadgroup``). Run one test after another, the suite kept the 2 cores only about 3/4 busy: its
single-process tests (JAX compiles) use a core or a little more, its jobs of several processes
(pservers, trainers, ranks, launched scripts) up to both, and some jobs mostly wait out a deadline. A
test marked ``serial`` starts such a job, or bounds a time that another job's load could stretch; every
one of them joins one xdist group (``SERIAL_GROUP``), so they run one at a time, on one worker, never two
jobs together, while the other worker runs the rest. Those marked ``serial(waits=True)`` (on a module's
``pytestmark``, so that its tests stay together) spend most of their time waiting (for a deadline, a lost
host, a stopped process) rather than computing: the group runs them first, while the other worker's tests
use the cores, and its CPU-bound jobs after them, which get the cores to themselves once the other worker
is done (in collection order the waiting jobs came last, alone, and left the cores about half idle for
the last two minutes). Without xdist nothing changes: ``-n 0`` runs every test in this process, in
collection order, and so does ``-p no:xdist`` (``pytest_addoption`` then takes the two options of
setup.cfg and ignores them).

The compilation cache: the suite starts hundreds of processes (pservers, trainers, launched scripts) that
compile the same few programs; each used to compile them again. A persistent cache in a directory made
for this session (``JAX_COMPILATION_CACHE_DIR``, inherited by every child process) lets the second
process load what the first compiled: the same executable, so results are unchanged (the bit-identical
tests still compare runs). The directory starts empty and is removed at the end of the session, so no
run sees another's cache. It needs ``filelock`` (a test dependency): with a size limit set, jax locks the
directory, so a process never reads an entry another is still writing. Without ``filelock``, or when
``JAX_COMPILATION_CACHE_DIR`` is already set, nothing is changed. Under pytest-xdist the controller
imports this file first and makes the directory; the workers it starts inherit the variable, so they
share that one directory (and make none), and only the controller, which made it, removes it.

The bytecode cache: where ``PYTHONDONTWRITEBYTECODE`` is set (so that no ``__pycache__`` litters the
tree), every one of those processes compiled each of the project's modules from source again, about 0.2 s
of CPU a process. For the session, child processes instead write and read bytecode under a directory made
for it (``PYTHONPYCACHEPREFIX``; the source tree stays clean), removed at the end like the JAX cache. The
bytecode is what the interpreter would compile from the same sources, so nothing a test checks changes.
Where ``PYTHONDONTWRITEBYTECODE`` is unset (Python caches bytecode anyway) or ``PYTHONPYCACHEPREFIX`` is
already set, nothing is changed; xdist's workers find it set by the controller and share its directory.
"""
from __future__ import annotations

import atexit
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


def _remove_caches() -> None:
    for folder in (_CACHE_DIR, _PYCACHE_DIR):  # None in xdist's workers: the controller made them
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


atexit.register(_remove_caches)  # also when pytest stops before configuring (a usage error)


def pytest_unconfigure(config: pytest.Config) -> None:
    _remove_caches()


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    parser.addoption("--update-goldens", action="store_true", default=False,
                     help="rewrite golden files with the current output instead of comparing")
    if not pluginmanager.hasplugin("xdist"):  # `-p no:xdist`, or not installed: setup.cfg still passes these
        parser.addoption("--numprocesses", default=None,
                         help="pytest-xdist's option, ignored: it is not loaded, every test runs in this process")
        parser.addoption("--dist", default="no",
                         help="pytest-xdist's option, ignored: it is not loaded, every test runs in this process")


SERIAL_GROUP = "serial"  # the xdist group of every test marked `serial`


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups off the items
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker, put every ``serial`` test in ``SERIAL_GROUP``: with ``--dist=loadgroup`` the
    group goes to one worker, which runs its tests one at a time (module- and session-scoped fixtures,
    such as a module's shared job, are then made once, there), in collection order except that the
    ``serial(waits=True)`` tests come first. Every worker sorts alike, so their collections still agree."""
    if not hasattr(config, "workerinput"):  # not an xdist worker: plain collection order, no groups
        return
    for item in items:
        if item.get_closest_marker("serial") is not None:
            item.add_marker(pytest.mark.xdist_group(SERIAL_GROUP))
    items.sort(key=lambda item: not _waits(item))  # stable: the rest keep their order


def _waits(item: pytest.Item) -> bool:
    marker = item.get_closest_marker("serial")
    return marker is not None and bool(marker.kwargs.get("waits", False))


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
