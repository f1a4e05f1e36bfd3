"""Fixtures the tests of the user-facing package share."""
from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="session")
def flotilla_exe() -> str:
    """The installed ``flotilla`` command (the console script of ``flotilla.cli``)."""
    exe = shutil.which("flotilla")
    if exe is None:
        pytest.fail("the `flotilla` executable is not on PATH; install the package with `pip install -e .`")
    return exe
