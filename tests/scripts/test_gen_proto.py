"""scripts/gen_proto.py: the checked-in ir/proto/framework_pb2.py is what protoc generates now, and
the ``protobuf`` pin in pyproject.toml admits exactly the runtimes its version guard accepts; the same
for runtime/rpc/send_recv_pb2*.py and the ``grpcio`` / ``grpcio-tools`` pins."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "gen_proto.py"
GENERATED = REPO_ROOT / "ir" / "proto" / "framework_pb2.py"
GENERATED_FILES = ("ir/proto/framework_pb2.py", "runtime/rpc/send_recv_pb2.py", "runtime/rpc/send_recv_pb2_grpc.py")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO_ROOT,
                          timeout=120, check=False)


def test_checked_in_code_is_current() -> None:
    result = _run("--check")
    assert result.returncode == 0, result.stderr
    for rel in GENERATED_FILES:
        assert f"{rel} is up to date" in result.stdout


def test_check_detects_a_stale_or_missing_file(tmp_path: pathlib.Path) -> None:
    for rel in GENERATED_FILES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((REPO_ROOT / rel).read_text(encoding="utf-8"), encoding="utf-8")
    assert _run("--check", "--root", str(tmp_path)).returncode == 0
    stale = tmp_path / "runtime" / "rpc" / "send_recv_pb2_grpc.py"
    stale.write_text(stale.read_text(encoding="utf-8").replace("SendVariable", "SendVar"), encoding="utf-8")
    (tmp_path / "ir" / "proto" / "framework_pb2.py").unlink()
    result = _run("--check", "--root", str(tmp_path))
    assert result.returncode == 1
    assert "send_recv_pb2_grpc.py differs from a fresh generation" in result.stderr
    assert "framework_pb2.py is missing" in result.stderr


def test_generate_writes_the_fresh_code(tmp_path: pathlib.Path) -> None:
    result = _run("--root", str(tmp_path))
    assert result.returncode == 0, result.stderr
    for rel in GENERATED_FILES:
        assert (tmp_path / rel).read_text(encoding="utf-8") == (REPO_ROOT / rel).read_text(encoding="utf-8")


def test_protobuf_pin_matches_the_generated_version_guard() -> None:
    code = GENERATED.read_text(encoding="utf-8")
    guard = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", code)
    assert guard is not None, "generated code has no runtime version guard"
    major, minor, patch = (int(g) for g in guard.groups())
    pyproject = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    pins = re.findall(r'"protobuf([^"]*)"', pyproject)
    assert pins == [f">={major}.{minor}.{patch},<{major + 1}"]


def test_grpc_pins_match_the_generated_stubs() -> None:
    code = (REPO_ROOT / "runtime" / "rpc" / "send_recv_pb2_grpc.py").read_text(encoding="utf-8")
    generated = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", code)
    assert generated is not None
    pyproject = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.findall(r'"grpcio([<>=][^"]*)"', pyproject) == [f">={generated.group(1)}"]
    assert re.findall(r'"grpcio-tools([^"]*)"', pyproject) == [f"=={generated.group(1)}"]
