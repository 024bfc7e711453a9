"""Regenerate the committed gRPC/protobuf modules from proto/*.proto.

    python proto/generate.py            # rewrite runtime/_rpc/ (installed as atoll._rpc)
    python proto/generate.py --out DIR  # write DIR/atoll/_rpc/ instead (the drift test compares)

The virtual include path makes the generated code import ``atoll._rpc.atoll_pb2`` as a package
module (the folder runtime/ is installed as the package ``atoll``, see pyproject.toml) rather than
a top-level ``atoll_pb2``. atoll.proto holds the two services and imports the message files
publicly, so ``atoll_pb2`` re-exports every message.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

WELL_KNOWN = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto (Struct)

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = "atoll/_rpc"  # the import path; the files live in runtime/_rpc
SCHEMAS = ("common", "controller", "worker", "ps", "atoll")
GENERATED = tuple(f"{name}_pb2.py" for name in SCHEMAS) + ("atoll_pb2_grpc.py",)
"""The committed modules (the message files define no service, so they get no _grpc module)."""


def generate(out_root: Path) -> Path:
    (out_root / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PACKAGE_DIR}={ROOT / 'proto'}",
        f"-I{WELL_KNOWN}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(ROOT / "proto" / f"{name}.proto") for name in SCHEMAS),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return out_root / PACKAGE_DIR


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="root under which atoll/_rpc/ is written")
    out = parser.parse_args().out
    if out is not None:
        written = generate(out)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            fresh = generate(Path(tmp))
            written = ROOT / "runtime" / "_rpc"
            for name in GENERATED:
                shutil.copyfile(fresh / name, written / name)
    print(f"wrote {written}", file=sys.stderr)


if __name__ == "__main__":
    main()
