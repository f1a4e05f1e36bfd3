"""Regenerate the checked-in protobuf code of the IR (``ir/proto/framework_pb2.py``).

Usage::

    python scripts/gen_proto.py            # rewrite ir/proto/framework_pb2.py
    python scripts/gen_proto.py --check    # exit 1 if the checked-in file is not a fresh generation

The code is generated with ``python -m grpc_tools.protoc`` (the ``grpcio-tools`` package carries
protoc), with the repository root as the include path, so the descriptor is registered as
``ir/proto/framework.proto`` (a unique name in the global descriptor pool) and the module as
``ir.proto.framework_pb2``. Generation always happens in a temporary directory: ``--check`` never
touches the checked-in file, and a failed generation never leaves a half-written one.

The generated module starts with a runtime version guard (``ValidateProtobufRuntimeVersion``):
the ``protobuf`` pin in ``pyproject.toml`` must admit exactly the runtimes that guard accepts.
"""
from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO = pathlib.Path("ir/proto/framework.proto")  # relative to ROOT, as protoc sees it
GENERATED = pathlib.Path("ir/proto/framework_pb2.py")


class GenerationError(Exception):
    """protoc is missing or failed."""


def generate(proto: pathlib.Path = PROTO, root: pathlib.Path = ROOT) -> str:
    """The text protoc generates for ``proto`` (a path relative to ``root``)."""
    with tempfile.TemporaryDirectory(prefix="flotilla-gen-proto-") as tmp:
        cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{root}", f"--python_out={tmp}", str(root / proto)]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip()
            raise GenerationError(
                f"protoc failed on {proto} (exit {result.returncode}): {detail}\n"
                "  hint: install the test extras (pip install -e '.[test]') for grpcio-tools"
            )
        out = pathlib.Path(tmp) / proto.with_name(proto.stem + "_pb2.py")
        if not out.exists():
            raise GenerationError(f"protoc succeeded but wrote no {out.name} for {proto}")
        return out.read_text(encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if the checked-in file differs from a fresh generation")
    parser.add_argument("--output", type=pathlib.Path, default=ROOT / GENERATED,
                        help="the generated file to write or check (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        fresh = generate()
    except GenerationError as exc:
        print(f"gen_proto: error: {exc}", file=sys.stderr)
        return 2
    target: pathlib.Path = args.output
    if args.check:
        current = target.read_text(encoding="utf-8") if target.exists() else None
        if current != fresh:
            what = "is missing" if current is None else "differs from a fresh generation"
            print(f"gen_proto: {target} {what} from {PROTO}\n"
                  "  hint: run python scripts/gen_proto.py and check in the result", file=sys.stderr)
            return 1
        print(f"gen_proto: {target} is up to date")
        return 0
    target.write_text(fresh, encoding="utf-8")
    print(f"gen_proto: wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
