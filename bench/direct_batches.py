"""Batches posted straight to their workers next to batches through the controller. Prints JSON.

    python bench/direct_batches.py [--sizes-kib 64 1024 16384] [--steps 20] [--rounds 3]

One job per way on a local cluster of 4 workers (2 stages x 2 replicas, an MLP whose first layer
reads a wide input), the same batches, alternating rounds: steps/s and the controller's and the
client's CPU per step at each batch size, and the ratio posted/through. With ``direct_batch_bytes``
below a batch's size the client posts each replica's rows to the workers that read them
(atoll.client.direct); otherwise the batch rides in the step through the controller, which cuts
it and sends each worker its part, so every byte is serialized and parsed twice more.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dispatch import _cpu_seconds  # noqa: E402

import atoll  # noqa: E402

WIDTH = 4096
"""Input features: a batch of ``rows`` rows holds rows * WIDTH * 4 bytes of inputs."""


def _job(client, rows: int, direct: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    x, y = torch.randn(rows, WIDTH), torch.randn(rows, 4)
    job = client.pipeline(
        model, example_input=x, example_target=y, loss_fn=F.mse_loss, stages=2, microbatches=2, data_parallel=2
    )
    job.direct_batch_bytes = 0 if direct else None
    return job, x, y


def _round(job, x, y, steps: int, pids: dict[str, int]) -> dict:
    before = {n: _cpu_seconds(p) for n, p in pids.items()}
    start = time.perf_counter()
    futures = [job.step_async(x, y) for _ in range(steps)]
    losses = [f.result() for f in futures]
    wall = time.perf_counter() - start
    cpu = {n: (_cpu_seconds(p) - before[n]) / steps * 1e3 for n, p in pids.items()}
    return {"steps_per_s": steps / wall, "cpu_ms": cpu, "last_loss": losses[-1]}


def compare(cluster: atoll.LocalCluster, sizes_kib: list[int], steps: int, rounds: int) -> dict:
    """Each size's figures for both ways, measured in alternating rounds on ``cluster``."""
    pids = {"client": os.getpid(), "controller": cluster.controller.pid}
    out = {}
    with cluster.client() as client:
        for kib in sizes_kib:
            rows = max(4, kib * 1024 // (WIDTH * 4) // 4 * 4)  # divisible by replicas x microbatches
            jobs = {way: _job(client, rows, way == "posted") for way in ("posted", "through_controller")}
            try:
                measured = {way: [] for way in jobs}
                for job, x, y in jobs.values():  # warm: connections, buffers, the route
                    job.step(x, y)
                for _ in range(rounds):
                    for way, (job, x, y) in jobs.items():
                        measured[way].append(_round(job, x, y, steps, pids))
                row = {"batch_bytes": rows * WIDTH * 4 + rows * 16, "rows": rows}
                for way, runs in measured.items():
                    row[way] = {
                        "steps_per_s": round(statistics.median(r["steps_per_s"] for r in runs), 2),
                        "controller_cpu_ms_per_step": round(
                            statistics.median(r["cpu_ms"]["controller"] for r in runs), 3
                        ),
                        "client_cpu_ms_per_step": round(statistics.median(r["cpu_ms"]["client"] for r in runs), 3),
                        "control_plane_tensor_bytes": sum(
                            m["control_plane_tensor_bytes"] for m in jobs[way][0].last.memory.values()
                        ),
                    }
                row["ratio_posted_vs_through"] = round(
                    row["posted"]["steps_per_s"] / row["through_controller"]["steps_per_s"], 3
                )
                row["same_losses"] = all(
                    a["last_loss"] == b["last_loss"] for a, b in zip(measured["posted"], measured["through_controller"])
                )
                out[f"{kib}KiB"] = row
            finally:
                for job, _, _ in jobs.values():
                    job.close()
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[64, 1024, 16384])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with atoll.LocalCluster(workers=4, threads_per_worker=1) as cluster:
        report = {
            "what": "2 stages x 2 replicas, MLP on a wide input; posted = batch straight to the workers",
            "torch": torch.__version__,
            "sizes": compare(cluster, args.sizes_kib, args.steps, args.rounds),
        }
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
