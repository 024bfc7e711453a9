"""The benchmarks run at their smallest size, so a change that breaks one fails here (the figures
themselves are not asserted: performance lives in the benchmarks' JSON). bench/layouts.py (8 workers,
every layout) is covered by the layout tests it shares its helpers with, and bench/transport.py
needs CUDA (tests/test_gpu.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cli as cli_bench

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.cluster  # runs commands in processes of their own


def test_cli_benchmark_runs(capsys):
    result = cli_bench.main(["--repeat", "1"])
    assert set(result) >= {"atoll_status_s", "atoll_status_help_s", "import_atoll_s"}
    assert all(v > 0 for k, v in result.items() if k.endswith("_s"))


def test_pipeline_benchmark_runs_at_its_smallest_size():
    args = ["--schedules", "gpipe", "--ranks", "2", "--microbatches", "2", "--batch", "4", "--layers", "2"]
    args += ["--d-model", "16", "--heads", "2", "--block-size", "8", "--rounds", "1", "--steps", "1", "--warmup", "1"]
    out = subprocess.run(
        [sys.executable, "bench/pipeline.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = json.loads(out.stdout)["rows"]
    assert row["atoll_steps_per_s"] > 0 and row["torch_pipelining_steps_per_s"] > 0
    assert row["first_round_loss_atoll"] == pytest.approx(row["first_round_loss_torch"], rel=1e-4)


def test_dispatch_benchmarks_simulated_workers_register_load_and_step():
    """bench/dispatch.py's part (d) at its smallest size: simulated workers (bench/sim_workers.py)
    register, take a plan (in pieces, as a real worker does) and answer steps, directly and relayed."""
    from bench import dispatch

    measured = dispatch.simulated_dispatch([4], 1)
    assert set(measured["4"]) == {"direct", "relay"}
    assert all(m["steps_per_s"] > 0 for m in measured["4"].values())
