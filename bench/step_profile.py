"""Where a tiny training step's CPU goes, process by process. Prints one JSON object.

    python bench/step_profile.py [--seconds 10] [--in-flight 16] [--per-call 1]

Starts a local cluster of 4 workers, loads the tiny 4-stage chain of bench/dispatch.py and keeps
``--in-flight`` calls of ``--per-call`` training steps each (``Job.steps_async`` above 1) in
flight for ``--seconds``, while py-spy (the ``bench`` extra, or
``pip install py-spy``) samples every process: the client (this process), the controller and each
worker. For each process it reports the CPU milliseconds per step (from /proc, so exact) and how
its samples split by the innermost Python frame's home:

  grpc        gRPC's Python layer (server polling, call state, channel machinery)
  asyncio     the controller's event loop and selectors
  threads     thread pools and hand-offs (concurrent.futures, threading)
  protobuf    message parsing and building
  torch       tensor compute and torch's Python
  atoll       atoll's own code (``atoll_executor``: the part of it under worker/executor)
  other       everything else

plus ``executor_inclusive``: the share of samples with the executor anywhere on the stack. Only
samples of a thread holding the GIL count (py-spy ``--gil``): Python's own work, not the time
threads wait, nor native code that released the GIL (gloo's transfers, most of a large kernel).
Shares sum to 1 per process; ``samples`` is how many there were (``--rate`` per second at most).
Without py-spy (or without permission to attach), the CPU figures come alone, with the reason.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dispatch import _cpu_seconds, process_pids, tiny  # noqa: E402

import atoll  # noqa: E402

CATEGORIES = (
    ("grpc", ("grpc/", "grpc_health/")),
    ("asyncio", ("asyncio/", "selectors.py")),
    ("threads", ("concurrent/futures/", "threading.py", "queue.py")),
    ("protobuf", ("google/protobuf/",)),
    ("torch", ("torch/",)),
    ("atoll_executor", ("atoll/worker/executor/", "runtime/worker/executor/")),
    ("atoll", ("atoll/", "runtime/", "controller/")),
)


def category(frame: str) -> str:
    """The home of one py-spy frame, ``function (path:line)``."""
    path = frame.rsplit("(", 1)[-1]
    return next((name for name, marks in CATEGORIES if any(m in path for m in marks)), "other")


def shares(raw: Path) -> dict:
    """Sample shares by the innermost frame's category, from py-spy's raw format (``a;b;c N``)."""
    by, executor, total = collections.Counter(), 0, 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames, n = stack.split(";"), int(count)
        by[category(frames[-1])] += n
        executor += n * any(category(f) == "atoll_executor" for f in frames)
        total += n
    out = {name: round(by[name] / total, 3) for name, _ in CATEGORIES if by[name]} if total else {}
    if total:
        out["other"] = round(by["other"] / total, 3)
        out["executor_inclusive"] = round(executor / total, 3)
    return {"samples": total, **out}


def profile(seconds: float, in_flight: int, rate: int, raw_dir: str | None = None, per_call: int = 1) -> dict:
    model, x = tiny(4)
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    report: dict = {"seconds": seconds, "in_flight": in_flight, "steps_per_call": per_call}
    with atoll.LocalCluster(workers=4, threads_per_worker=1) as cluster, cluster.client() as client:
        job = client.pipeline(model, example_input=x, example_target=x, loss_fn=F.mse_loss, stages=4, microbatches=1)
        pids = process_pids(cluster)
        job.max_in_flight = in_flight
        for _ in range(20):  # warm: connections, buffers
            job.step(x, x)
        out = Path(raw_dir) if raw_dir else Path(tempfile.mkdtemp(prefix="atoll-profile-"))
        out.mkdir(parents=True, exist_ok=True)
        spies = {}
        if Path(spy).exists():
            for name, pid in pids.items():
                # --gil: only samples of a thread holding the GIL, so a thread waiting on a lock,
                # a selector or a socket (which py-spy may count as busy otherwise) is not counted
                cmd = [spy, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw", "--nonblocking"]
                cmd += ["--gil", "--duration", str(max(1, round(seconds))), "--output", str(out / f"{name}.txt")]
                spies[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        else:
            report["py_spy"] = "not installed (pip install py-spy): CPU figures only"
        before, start, futures = {n: _cpu_seconds(p) for n, p in pids.items()}, time.perf_counter(), []
        while time.perf_counter() - start < seconds:  # the job's window (max_in_flight) holds the calls back
            futures += [job.step_async(x, x)] if per_call == 1 else job.steps_async([(x, x)] * per_call)
        steps = len([f.result() for f in futures])
        wall = time.perf_counter() - start
        cpu = {n: (_cpu_seconds(p) - before[n]) / steps * 1e3 for n, p in pids.items()}
        errors = {}
        for name, proc in spies.items():
            try:
                _, err = proc.communicate(timeout=seconds + 60)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if proc.returncode != 0 or not (out / f"{name}.txt").exists():
                errors[name] = (err or "").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        if errors:
            report["py_spy"] = f"failed on {sorted(errors)}: {next(iter(errors.values()))[0]}"
        report["steps"], report["steps_per_s"] = steps, round(steps / wall, 1)
        report["cpu_ms_per_step"] = {n: round(v, 3) for n, v in cpu.items()} | {"total": round(sum(cpu.values()), 3)}
        report["processes"] = {
            name: shares(out / f"{name}.txt") for name in pids if name in spies and name not in errors
        }
        if not raw_dir:
            shutil.rmtree(out, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--raw-dir", help="keep py-spy's raw samples here, one file per process")
    parser.add_argument("--per-call", type=int, default=1, help="steps sent together (Job.steps_async)")
    args = parser.parse_args(argv)
    report = profile(args.seconds, args.in_flight, args.rate, args.raw_dir, args.per_call)
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
