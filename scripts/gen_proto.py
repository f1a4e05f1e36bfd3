"""Regenerate the checked-in protobuf code: the IR's ``ir/proto/framework_pb2.py`` and the
parameter-server protocol's ``runtime/rpc/send_recv_pb2.py`` + ``send_recv_pb2_grpc.py``.

Usage::

    python scripts/gen_proto.py                  # rewrite the generated files in the repository
    python scripts/gen_proto.py --check          # exit 1 if a checked-in file is not a fresh generation
    python scripts/gen_proto.py --root DIR ...   # write (or check) the files under DIR instead

The code is generated with ``python -m grpc_tools.protoc`` (the ``grpcio-tools`` package carries
protoc and the gRPC plugin), with the repository root as the include path, so each descriptor is
registered under its repository path (a unique name in the global descriptor pool) and each module
under its package (``ir.proto.framework_pb2``, ``runtime.rpc.send_recv_pb2``). Generation always
happens in a temporary directory: ``--check`` never touches the checked-in files, and a failed
generation never leaves a half-written one.

The generated modules start with runtime version guards: the ``protobuf`` pin in ``pyproject.toml``
must admit exactly the runtimes the protobuf guard accepts, and ``grpcio`` must be at least the
version of the ``grpcio-tools`` pinned in the test extras.
"""
from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Target:
    proto: pathlib.Path  # relative to ROOT, as protoc sees it
    grpc: bool  # also generate the service stubs (<stem>_pb2_grpc.py)

    @property
    def outputs(self) -> list[pathlib.Path]:
        stems = [self.proto.stem + "_pb2"] + ([self.proto.stem + "_pb2_grpc"] if self.grpc else [])
        return [self.proto.with_name(s + ".py") for s in stems]


TARGETS = (
    Target(pathlib.Path("ir/proto/framework.proto"), grpc=False),
    Target(pathlib.Path("runtime/rpc/send_recv.proto"), grpc=True),
)


class GenerationError(Exception):
    """protoc is missing or failed."""


def generate(target: Target, root: pathlib.Path = ROOT) -> dict[pathlib.Path, str]:
    """The text protoc generates for each output of ``target``, by path relative to ``root``."""
    with tempfile.TemporaryDirectory(prefix="flotilla-gen-proto-") as tmp:
        cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{root}", f"--python_out={tmp}"]
        if target.grpc:
            cmd.append(f"--grpc_python_out={tmp}")
        result = subprocess.run(cmd + [str(root / target.proto)], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip()
            raise GenerationError(
                f"protoc failed on {target.proto} (exit {result.returncode}): {detail}\n"
                "  hint: install the test extras (pip install -e '.[test]') for grpcio-tools"
            )
        texts = {}
        for rel in target.outputs:
            out = pathlib.Path(tmp) / rel
            if not out.exists():
                raise GenerationError(f"protoc succeeded but wrote no {out.name} for {target.proto}")
            texts[rel] = out.read_text(encoding="utf-8")
        return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if a checked-in file differs from a fresh generation")
    parser.add_argument("--root", type=pathlib.Path, default=ROOT,
                        help="directory the generated files are written to or checked in (default: the repository)")
    args = parser.parse_args(argv)
    stale = 0
    for target in TARGETS:
        try:
            fresh = generate(target)
        except GenerationError as exc:
            print(f"gen_proto: error: {exc}", file=sys.stderr)
            return 2
        for rel, text in fresh.items():
            path = args.root / rel
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
                print(f"gen_proto: wrote {path}")
                continue
            current = path.read_text(encoding="utf-8") if path.exists() else None
            if current != text:
                what = "is missing" if current is None else "differs from a fresh generation"
                print(f"gen_proto: {path} {what} from {target.proto}\n"
                      "  hint: run python scripts/gen_proto.py and check in the result", file=sys.stderr)
                stale += 1
            else:
                print(f"gen_proto: {path} is up to date")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
