"""The README's main job and the `atoll plan` command, run as a user runs them."""

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from atoll.cli import commands as cli

pytestmark = pytest.mark.cluster  # every test here starts processes

ROOT = Path(__file__).resolve().parent.parent


def _plan(*args: str) -> str:
    """What ``atoll plan examples/gpt_plan.py ARGS`` prints (run in this process: the command
    itself is run as a user runs it in the first test below)."""
    out = io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(out):
        cli.main(["plan", "examples/gpt_plan.py", *args])
    return out.getvalue()


def test_main_job_trains_and_the_loss_falls():
    run = subprocess.run(
        [sys.executable, "examples/train_gpt.py", "--steps", "12"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    first, last = map(float, re.search(r"loss: first 5 steps ([\d.]+) -> last 5 steps ([\d.]+)", run.stdout).groups())
    assert last < first
    assert "step 12/12" in run.stdout and "steps/s" in run.stdout


def test_atoll_plan_prints_the_plan_without_a_cluster():
    run = subprocess.run(
        [sys.executable, "-m", "atoll.cli", "plan", "examples/gpt_plan.py", "--schedule", "gpipe", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    plan = json.loads(run.stdout)
    assert plan["schedule"] == "gpipe" and plan["ranks"] == 4 and plan["placement"] == {}
    assert set(plan["predicted_memory"]) == {"0", "1", "2", "3"}
    for memory in plan["predicted_memory"].values():
        assert memory["total"] == sum(
            memory[k] for k in ("parameters", "gradients", "optimizer", "activations", "buffers")
        )
        assert memory["peak_stashed_microbatches"] == 8
    assert plan["actions"]["3"][-1] == "3STEP"
    text = _plan()
    assert "schedule 1f1b" in text and "rank 3:" in text and "predicted peak MiB per rank" in text
    assert "predicted bytes per training step" in text
    layout = _plan("--stages", "2", "--data-parallel", "2")
    assert "2 ranks x 1 chunk(s)" in layout and "2 data-parallel replicas" in layout, layout
    rows = [line for line in layout.splitlines() if line.startswith("  rank ") and "/" in line]
    all_reduced = [int(row.split("/")[2]) for row in rows]  # sent / received / all-reduced / island
    assert len(all_reduced) == 2 and all(n > 0 for n in all_reduced)  # each rank's gradients, averaged
    sharded = _plan("--stages", "2", "--tensor-parallel", "2")
    assert "layout: pipeline 2 x tensor 2 x data 1 = 4 workers" in sharded, sharded
    assert "colwise: " in sharded and "rowwise: " in sharded and "vocab_embedding: " in sharded
    rows = [line for line in sharded.splitlines() if line.startswith("  rank ") and "/" in line]
    assert len(rows) == 2 and all(int(row.split("/")[3]) > 0 for row in rows)  # the islands' all-reduces
    auto = _plan("--schedule", "auto")  # no workers to calibrate on: the stages' FLOPs stand in
    assert "auto (flops costs): 1f1b " in auto and "the shortest predicted step" in auto, auto
