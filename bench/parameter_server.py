"""Benchmark: a parameter-server job under a straggler, by consistency, next to DDP.

``--tasks`` worker tasks (4) train an MLP on their own batches through ``--servers`` server
workers; one task at a time is a straggler whose steps take 3x as long. Each step also waits
``--compute-ms`` as if a device computed for that long (the straggler three times as long): on a
host with fewer cores than processes, CPU-bound tasks would soak up the CPU a sleeping straggler
frees and hide what consistency does; ``--compute-ms 0`` measures that case (the straggler then
sleeps twice the system's own median step, measured first without a straggler). Two straggler
patterns (``--straggler``): ``rotating`` (each step a different task is the slow one: transient
slowness, as garbage collection, preemption or a skewed batch cause) and ``fixed`` (task 0 is
slow at every step). The same model, batches and straggler pattern train under DDP (gloo, one
process per task). Prints one JSON object: task-steps/s per consistency and for DDP (the sum
over tasks of each task's steps over its own time), and the ratios of bounded delay
(``--max-delay``) to sequential and to DDP.

Under a fixed straggler no consistency that bounds staleness can beat sequential for long: the
fast tasks may run only ``max_delay`` iterations ahead, then go at the slow one's pace (eventual
consistency, which never waits, is printed beside it for that reason).

    python bench/parameter_server.py [--tasks 4] [--steps 40]
    python bench/parameter_server.py --compute-ms 0     # CPU-bound tasks, the straggler sleeps
    python bench/parameter_server.py --steps 3 --width 16 --depth 1 --straggler rotating   # smallest (smoke test)

Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline import TorchSide, median  # noqa: E402

import atoll  # noqa: E402


def make_model(args) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(args.depth):
        layers += [nn.Linear(args.width, args.width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(args.width, 10))


def batches(args, task: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + task)
    return [(torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g))
            for _ in range(steps)]  # fmt: skip


def is_slow(pattern: str, task: int, step: int, tasks: int) -> bool:
    """The straggler pattern, as data: which task is slow at which step."""
    if pattern == "none":
        return False
    return task == (step % tasks if pattern == "rotating" else 0)


# ------------------------------------------------------------------ atoll


def emulated_s(args, pattern: str, task: int, step: int, tasks: int) -> float:
    """The device time a step stands for (0 without ``--compute-ms``): three times as long for the straggler."""
    return args.compute_ms / 1000 * (3 if is_slow(pattern, task, step, tasks) else 1)


def run_ps(job, args, pattern: str, straggler_s: float, steps: int) -> tuple[float, list[float]]:
    """(task-steps/s: the sum of each task's steps over its own time, each step's duration as its
    task saw it), every task stepped in its own thread. Emulated device time is spent inside the
    step, between its pull and its push, where a device would compute."""
    durations: list[float] = []
    elapsed = [0.0] * job.tasks

    def feed(task: int) -> None:
        started = time.perf_counter()
        for i, batch in enumerate(batches(args, task, steps)):
            if not args.compute_ms and is_slow(pattern, task, i, job.tasks):
                time.sleep(straggler_s)
            begun = time.perf_counter()
            job.step_task(task, *batch, emulated_compute_s=emulated_s(args, pattern, task, i, job.tasks))
            durations.append(time.perf_counter() - begun)
        elapsed[task] = time.perf_counter() - started

    threads = [threading.Thread(target=feed, args=(t,)) for t in range(job.tasks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not all(elapsed):
        raise RuntimeError("a task failed (see above)")
    return sum(steps / e for e in elapsed), durations


def atoll_side(client, args, pattern: str) -> dict:
    model = make_model(args)
    x, y = batches(args, 0, 1)[0]
    report = {}
    delay_s = None
    for consistency in ("sequential", "bounded", "eventual"):
        with client.parameter_server(
            model, example_input=x, example_target=y, loss_fn=F.cross_entropy, servers=args.servers,
            workers=args.tasks, consistency=consistency, max_delay=args.max_delay, optimizer="sgd", lr=0.05,
        ) as job:  # fmt: skip
            run_ps(job, args, "none", 0.0, args.warmup)
            if delay_s is None and not args.compute_ms:  # 3x the sequential job's own median step
                _, durations = run_ps(job, args, "none", 0.0, max(3, args.warmup))
                delay_s = 2 * median(durations)
            start = len(job.records)
            rate, _ = run_ps(job, args, pattern, delay_s, args.steps)
            records = job.records[start:]
            report[consistency] = {
                "task_steps_per_s": rate,
                "max_staleness": max(r.staleness for r in records),
                "mean_waited_s": sum(r.waited_s for r in records) / len(records),
                "last_loss": records[-1].loss,
            }
    report["straggler_sleep_s"] = delay_s or 0.0
    return report


# ------------------------------------------------------------------ DDP


def _ddp_rank(rank: int, world: int, port: int, args, go, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = nn.parallel.DistributedDataParallel(make_model(args))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(x, y) -> float:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    results.put("ready")
    while (request := go[rank].get()) != 0:  # TorchSide.close sends 0
        pattern, delay_s, steps = request
        durations = []
        dist.barrier()
        started = time.perf_counter()
        for i, (x, y) in enumerate(batches(args, rank, steps)):
            if args.compute_ms:
                time.sleep(emulated_s(args, pattern, rank, i, world))
            elif is_slow(pattern, rank, i, world):
                time.sleep(delay_s)
            t0 = time.perf_counter()
            step(x, y)
            durations.append(time.perf_counter() - t0)
        dist.barrier()
        if rank == 0:
            results.put((world * steps / (time.perf_counter() - started), median(durations)))
    dist.destroy_process_group()


class DdpSide(TorchSide):
    """DDP ranks in their own processes, each request run between two barriers (bench/pipeline.py's TorchSide)."""

    def __init__(self, args):
        self._start(_ddp_rank, args.tasks, (args,))

    def ask(self, pattern: str, straggler_s: float, steps: int) -> tuple[float, float]:
        """(task-steps/s, rank 0's median step) of ``steps`` steps under the straggler ``pattern``."""
        for q in self.go:
            q.put((pattern, straggler_s, steps))
        return self._result(600)


def ddp_side(args, pattern: str) -> dict:
    side = DdpSide(args)
    try:
        side.ask("none", 0.0, args.warmup)
        _, step_s = side.ask("none", 0.0, max(3, args.warmup))
        straggler_s = 0.0 if args.compute_ms else 2 * step_s
        rate, _ = side.ask(pattern, straggler_s, args.steps)
        return {"task_steps_per_s": rate, "straggler_sleep_s": straggler_s}
    finally:
        side.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40, help="steps per task, timed")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-delay", type=int, default=2)
    parser.add_argument("--compute-ms", type=float, default=30.0, help="emulated device time per step (0: none)")
    parser.add_argument("--straggler", choices=("rotating", "fixed", "both"), default="both")
    args = parser.parse_args()
    patterns = ("rotating", "fixed") if args.straggler == "both" else (args.straggler,)
    report = {
        "bench": "parameter_server",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "settings": {k: v for k, v in vars(args).items()},
        "parameters": sum(p.numel() for p in make_model(args).parameters()),
    }
    with atoll.LocalCluster(workers=args.servers + args.tasks) as cluster, cluster.client() as client:
        for pattern in patterns:
            ps = atoll_side(client, args, pattern)
            ddp = ddp_side(args, pattern)
            bounded = ps["bounded"]["task_steps_per_s"]
            report[pattern] = {
                "atoll": ps,
                "ddp": ddp,
                "bounded_vs_sequential": bounded / ps["sequential"]["task_steps_per_s"],
                "bounded_vs_ddp": bounded / ddp["task_steps_per_s"],
                "eventual_vs_sequential": ps["eventual"]["task_steps_per_s"] / ps["sequential"]["task_steps_per_s"],
            }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
