"""One tenant of tests/test_multi_tenant.py, as its own client process:

    python -m tests.tenant ADDRESS TOKEN_FILE SEED STEPS GO_FILE OUT_FILE

Submits a 4-stage job, prints "ready", waits for GO_FILE, trains, and saves its losses, the
monotonic time each step ended and the final weights to OUT_FILE."""

import sys
import time
from collections import deque
from pathlib import Path

import torch

import atoll
from tests import models
from tests.test_pipeline_parity import OPTIMIZERS

SGD = OPTIMIZERS["sgd"]


def train_timed(job, batches, in_flight: int = 4) -> tuple[list[float], list[float]]:
    """Train with up to ``in_flight`` steps outstanding; returns the losses and the monotonic time
    each step's result arrived (CLOCK_MONOTONIC: comparable across processes on one host)."""
    pending, losses, ended = deque(), [], []
    for x, y in batches:
        if len(pending) == in_flight:
            losses.append(pending.popleft().result())
            ended.append(time.monotonic())
        pending.append(job.step_async(x, y))
    while pending:
        losses.append(pending.popleft().result())
        ended.append(time.monotonic())
    return losses, ended


def main() -> None:
    address, token_file, seed, steps, go, out = sys.argv[1:]
    seed, steps = int(seed), int(steps)
    with atoll.connect(address, token_file=token_file) as client:
        model, batches, loss_fn = models.mlp(seed)
        x, y = batches[0]
        job = client.pipeline(
            model, example_input=x, example_target=y, loss_fn=loss_fn, stages=4, microbatches=2,
            schedule="1f1b", optimizer_args=SGD, name=f"tenant{seed}",
        )  # fmt: skip
        print("ready", flush=True)
        deadline = time.monotonic() + 120
        while not Path(go).exists():
            if time.monotonic() > deadline:
                raise SystemExit("never told to start")
            time.sleep(0.01)
        losses, ended = train_timed(job, [batches[i % len(batches)] for i in range(steps)])
        torch.save({"losses": losses, "ended": ended, "state": job.state_dict()}, out)
        job.close()


if __name__ == "__main__":
    main()
