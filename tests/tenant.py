"""One tenant of tests/test_multi_tenant.py, as its own client process:

    python -m tests.tenant ADDRESS TOKEN_FILE SEED STEPS GO_FILE OUT_FILE

Submits a 4-stage job, prints "ready", waits for GO_FILE, trains, and saves its losses, when each
step began on each worker (from the job's timelines) and the final weights to OUT_FILE."""

import sys
import time
from collections import deque
from pathlib import Path

import torch

import atoll
from tests import models
from tests.test_pipeline_parity import OPTIMIZERS

SGD = OPTIMIZERS["sgd"]

# Steps each tenant keeps queued: deep enough that a client process the host leaves unscheduled
# for a while still has steps waiting at the controller, so the dispatch order is the fair
# queue's alone (the controller serves 128 request threads; three tenants hold 48 at most).
IN_FLIGHT = 16


def train_queued(job, batches, in_flight: int = IN_FLIGHT) -> list[float]:
    """Train with up to ``in_flight`` steps outstanding; returns the losses."""
    job.max_in_flight = in_flight
    pending, losses = deque(), []
    for x, y in batches:
        if len(pending) == in_flight:
            losses.append(pending.popleft().result())
        pending.append(job.step_async(x, y))
    losses += [f.result() for f in pending]
    return losses


def step_starts(job, steps: int) -> dict[str, dict[int, float]]:
    """Worker id -> step -> when the step began there (the job's timelines; workers keep 64 steps)."""
    return job.timeline(list(range(1, steps + 1))).step_starts()


def shares_when_the_first_finished(starts: dict[str, dict[str, dict[int, float]]]) -> dict[str, int]:
    """Per job (name -> step_starts), the steps it had begun on a worker all the jobs share when
    the first job began its last step there. Read off that worker's own sequence of steps (its
    gang order, the order the controller dispatched them), not off clocks in the clients, so it
    measures the controller's fair queue and not how promptly each client was scheduled."""
    (worker, *_) = sorted(set.intersection(*(set(s) for s in starts.values())))
    on_worker = {name: s[worker] for name, s in starts.items()}
    first_done = min(max(s.values()) for s in on_worker.values())
    return {name: sum(t <= first_done for t in s.values()) for name, s in on_worker.items()}


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
        losses = train_queued(job, [batches[i % len(batches)] for i in range(steps)])
        started = step_starts(job, steps)
        torch.save({"losses": losses, "started": started, "state": job.state_dict()}, out)
        job.close()


if __name__ == "__main__":
    main()
