"""scripts/gen_proto.py: the checked-in ir/proto/framework_pb2.py is what protoc generates now, and
the ``protobuf`` pin in pyproject.toml admits exactly the runtimes its version guard accepts."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "gen_proto.py"
GENERATED = REPO_ROOT / "ir" / "proto" / "framework_pb2.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO_ROOT,
                          timeout=120, check=False)


def test_checked_in_code_is_current() -> None:
    result = _run("--check")
    assert result.returncode == 0, result.stderr
    assert "is up to date" in result.stdout


def test_check_detects_a_stale_file(tmp_path: pathlib.Path) -> None:
    stale = tmp_path / "framework_pb2.py"
    stale.write_text(GENERATED.read_text(encoding="utf-8").replace("flotilla.framework", "flotilla.other"))
    result = _run("--check", "--output", str(stale))
    assert result.returncode == 1
    assert "differs from a fresh generation" in result.stderr
    missing = _run("--check", "--output", str(tmp_path / "absent_pb2.py"))
    assert missing.returncode == 1 and "is missing" in missing.stderr


def test_generate_writes_the_fresh_code(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "framework_pb2.py"
    result = _run("--output", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_text(encoding="utf-8") == GENERATED.read_text(encoding="utf-8")


def test_protobuf_pin_matches_the_generated_version_guard() -> None:
    code = GENERATED.read_text(encoding="utf-8")
    guard = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", code)
    assert guard is not None, "generated code has no runtime version guard"
    major, minor, patch = (int(g) for g in guard.groups())
    pyproject = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    pins = re.findall(r'"protobuf([^"]*)"', pyproject)
    assert pins == [f">={major}.{minor}.{patch},<{major + 1}"]
