"""Timeline of a balanced pipeline: measured per worker next to the compiler's prediction.

    python examples/trace_pipeline.py --out /tmp/atoll-trace     # trace.json, trace.png, summary
    python examples/trace_pipeline.py --schedule 1f1b --microbatches 8

Trains a model of four identical residual MLP blocks on a 4-stage pipeline (one block per stage)
on an embedded LocalCluster, then asks for the timelines of the last steps: trace.json (open in
https://ui.perfetto.dev or chrome://tracing) and trace.png (needs matplotlib: atoll[plot]). Prints
each worker's measured bubble fraction beside the predicted one as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import atoll  # noqa: E402


class Block(nn.Module):
    """A pre-norm residual MLP block. The norm keeps the backward of the first stage as costly as
    the others': its weights need the gradient of the first linear's input, which the first stage
    would otherwise skip (its input, the batch, needs none)."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, h):
        return h + self.ff(self.norm(h))


def balanced_model(width: int, hidden: int, stages: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width, hidden) for _ in range(stages)])


def traced_job(
    client: atoll.Client,
    *,
    stages: int = 4,
    microbatches: int = 16,
    schedule: str = "gpipe",
    width: int = 64,
    hidden: int = 16384,
    rows_per_microbatch: int = 128,
    steps: int = 6,
    traced: int = 3,
) -> tuple[atoll.Job, atoll.Trace]:
    """Train ``steps`` steps and return the job with the timelines of its last ``traced`` (the first
    steps warm up allocators and connections)."""
    g = torch.Generator().manual_seed(1)
    batch = rows_per_microbatch * microbatches
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    job = client.pipeline(
        balanced_model(width, hidden, stages),
        example_input=x,
        example_target=y,
        loss_fn=F.mse_loss,
        stages=stages,
        microbatches=microbatches,
        schedule=schedule,
        split_points=[str(i) for i in range(1, stages)],
    )
    for _ in range(steps):
        job.step(x, y)
    return job, job.timeline(last=traced)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="atoll-trace", help="folder for trace.json and trace.png")
    parser.add_argument("--schedule", default="gpipe", choices=["gpipe", "1f1b"])
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6, help="training steps; the last --traced are shown")
    parser.add_argument("--traced", type=int, default=3)
    parser.add_argument("--no-png", action="store_true", help="skip the picture (no matplotlib needed)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with atoll.LocalCluster(workers=4) as cluster, cluster.client() as client:
        job, trace = traced_job(
            client, microbatches=args.microbatches, schedule=args.schedule, steps=args.steps, traced=args.traced
        )
        job.close()
    trace.save(out / "trace.json")
    if not args.no_png:
        trace.plot(out / "trace.png")
    keys = ("measured_bubble", "predicted_bubble", "predicted_bubble_at_measured_costs")
    rows = {f"worker {w['worker']}": {k: round(w[k], 3) for k in keys} for w in trace.summary["workers"]}
    if trace.summary["note"]:
        print(trace.summary["note"], file=sys.stderr)
    print(json.dumps({"steps": trace.summary["steps"], "bubble": rows, "files": sorted(map(str, out.iterdir()))}))


if __name__ == "__main__":
    main()
