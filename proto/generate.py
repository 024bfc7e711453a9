"""Regenerate the committed gRPC/protobuf modules from proto/atoll.proto.

    python proto/generate.py            # rewrite runtime/_rpc/
    python proto/generate.py --out DIR  # write into DIR instead (the drift test compares)

The virtual include path makes the generated code import ``runtime._rpc.atoll_pb2`` as a
package module rather than a top-level ``atoll_pb2``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = "runtime/_rpc"


def generate(out_root: Path) -> Path:
    (out_root / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PACKAGE_DIR}={ROOT / 'proto'}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        str(ROOT / "proto" / "atoll.proto"),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return out_root / PACKAGE_DIR


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT, help="root under which runtime/_rpc/ is written")
    written = generate(parser.parse_args().out)
    print(f"wrote {written}", file=sys.stderr)


if __name__ == "__main__":
    main()
