"""Shared pytest setup: the ``--update-goldens`` option and the ``golden`` fixture."""
from __future__ import annotations

import pathlib

import pytest


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
