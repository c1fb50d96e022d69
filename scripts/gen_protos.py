#!/usr/bin/env python3
"""Regenerate the Python stubs of ``tandem.v1`` from ``protos/tandem/v1/*.proto``.

Run from anywhere: ``python scripts/gen_protos.py``. Writes ``tandem/v1/*_pb2.py``,
``*_pb2.pyi`` and ``*_pb2_grpc.py`` at the repository root, so that they import as
``from tandem.v1 import engine_pb2``. ``tests/test_protos.py`` fails when the
committed stubs no longer match the .proto files.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PACKAGE_DIR = Path("tandem") / "v1"


def proto_files() -> list[Path]:
    """The .proto files of the package, relative to PROTO_ROOT, in a stable order."""
    files = sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    if not files:
        raise FileNotFoundError(f"no .proto files under {PROTO_ROOT / PACKAGE_DIR}")
    return [f.relative_to(PROTO_ROOT) for f in files]


def _run_protoc(args: list[str]) -> None:
    # grpc_tools ships the well-known types (google/protobuf/*.proto) as package data.
    well_known = str(resources.files("grpc_tools") / "_proto")
    argv = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", *args]
    argv += [str(f) for f in proto_files()]
    if protoc.main(argv) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(argv)}")


def generate(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Write the stubs under ``out_dir / tandem / v1`` and return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = str(out_dir)
    _run_protoc([f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}"])
    return sorted((out_dir / PACKAGE_DIR).glob("*_pb2*.py*"))


def write_descriptor_set(path: Path) -> None:
    """Write the FileDescriptorSet of the .proto files (no source info) to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _run_protoc([f"--descriptor_set_out={path}"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT, help="root directory to write tandem/v1/ under"
    )
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
