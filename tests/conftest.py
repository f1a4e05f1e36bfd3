"""Shared pytest setup: the ``--update-goldens`` option, the ``golden`` fixture, and ``netns_hosts`` (hosts
as network namespaces, ``tests/netns.py``)."""
from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Callable, Iterator

import pytest

if TYPE_CHECKING:
    from tests.netns import Hosts


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
