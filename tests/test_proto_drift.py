"""The committed gRPC/protobuf modules are exactly what proto/generate.py makes from proto/*.proto."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster  # runs commands in processes of their own

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "proto"))
from generate import GENERATED  # noqa: E402


def test_generated_modules_match_the_schema(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--out", str(tmp_path)],
        check=True,
        timeout=120,
        capture_output=True,
    )
    assert "atoll_pb2.py" in GENERATED and "atoll_pb2_grpc.py" in GENERATED
    for name in GENERATED:
        fresh = (tmp_path / "atoll" / "_rpc" / name).read_text()
        committed = (ROOT / "runtime" / "_rpc" / name).read_text()
        assert fresh == committed, f"runtime/_rpc/{name} is stale: run python proto/generate.py"
