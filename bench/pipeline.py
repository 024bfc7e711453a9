"""Benchmark: atoll pipelines vs torch.distributed.pipelining, side by side in one run.

    python bench/pipeline.py                      # GPipe, 1F1B, interleaved 1F1B on CPU/gloo
    python bench/pipeline.py --schedules gpipe --steps 20
    python bench/pipeline.py --device cuda        # 4 workers on one GPU vs one process on it

On CPU, both sides train the same GPT-style model (examples/gpt.py) from the same initial weights, with
the same stage boundaries (atoll's cost-balanced partition, reused for torch), the same
microbatches, the same number of processes (one per pipeline rank, gloo between them) and the
same intra-op threads per process.

Small shared machines are noisy, so the two are measured in alternating rounds while both sets of
processes stay up (atoll, torch, atoll, torch, ...): each round gives a ratio, and the report
gives per-round ratios and their median. Prints one JSON object; ratio = atoll / torch steps per
second (above 1 means atoll is faster). atoll is measured twice per round: with ``job.step``
(each step waits for the previous) and with ``job.step_async`` (a round's steps are all sent
before waiting, as a Pathways client would). On CPU the report also gives the CPU milliseconds
each side's processes spent per step (atoll's client, controller and workers; torch's ranks): with
more processes than cores, the rates follow it. Nothing here asserts on time.

With ``--device cuda`` the peer is the same model trained in one process on the same GPU (same
microbatches, optimizer and batches; no pipeline, so no bubble): ratio = atoll / single process.
The atoll workers all share that GPU and talk over CUDA IPC. The report adds each rank's measured
waiting fraction (time blocked on the data plane over the step's wall time).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dispatch import _cpu_seconds, process_pids  # noqa: E402

import atoll  # noqa: E402
from examples.gpt import CharCorpus, GPTConfig, build_gpt, lm_loss  # noqa: E402

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


def make_setup(args):
    torch.manual_seed(0)
    corpus = CharCorpus()
    cfg = GPTConfig(
        vocab_size=corpus.vocab_size,
        n_layers=args.layers,
        d_model=args.d_model,
        n_heads=args.heads,
        block_size=args.block_size,
    )
    model = build_gpt(cfg).to(getattr(torch, args.dtype))
    g = torch.Generator().manual_seed(0)
    batches = [corpus.batch(args.batch, cfg.block_size, g) for _ in range(16)]
    return model, batches


class AtollSide:
    def __init__(self, client, model, batches, args, schedule: str, virtual: int):
        x, y = batches[0]
        self.job = client.pipeline(
            model,
            example_input=x,
            example_target=y,
            loss_fn=lm_loss,
            stages=args.ranks,
            microbatches=args.microbatches,
            schedule=schedule,
            virtual_stages=virtual,
            optimizer="sgd",
            optimizer_args={"lr": 0.01},
            device=args.device,
        )
        self.batches, self.args, self.next = batches, args, 0
        self.stage_blocks = [[int(b) for b in s["modules"]] for s in self.job.plan.report["stages"]]
        self.run(args.warmup)

    def run(self, steps: int, pipelined: bool = False) -> tuple[float, float]:
        """Returns (steps per second, last loss). ``pipelined`` sends every step of the round
        before waiting (step_async), so the controller dispatches step k+1 while k runs."""
        start = time.perf_counter()
        futures = []
        for _ in range(steps):
            x, y = self.batches[self.next % len(self.batches)]
            self.next += 1
            futures.append(self.job.step_async(x, y))
            if not pipelined:
                futures[-1].result()
        loss = [f.result() for f in futures][-1]
        return steps / (time.perf_counter() - start), loss

    def close(self) -> None:
        self.job.close()


def _torch_rank(rank, world, port, args, schedule, virtual, stage_blocks, go, results):
    from torch.distributed import pipelining

    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    model, batches = make_setup(args)
    blocks = list(model.children())
    num_stages = world * virtual
    stage_ids = [rank + k * world for k in range(virtual)]
    stages = [
        pipelining.PipelineStage(
            torch.nn.Sequential(*[blocks[i] for i in stage_blocks[s]]), s, num_stages, torch.device("cpu")
        )
        for s in stage_ids
    ]
    opt = torch.optim.SGD([p for st in stages for p in st.submod.parameters()], lr=0.01)
    cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
    sched = cls(stages if schedule == "interleaved_1f1b" else stages[0], args.microbatches, loss_fn=lm_loss)
    holds_first, holds_last = 0 in stage_ids, num_stages - 1 in stage_ids
    step_index = 0

    def step():
        nonlocal step_index
        x, y = batches[step_index % len(batches)]
        step_index += 1
        losses: list = []
        kwargs = {"target": y, "losses": losses} if holds_last else {}
        sched.step(x, **kwargs) if holds_first else sched.step(**kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return sum(losses).item() / len(losses) if losses else None

    for _ in range(args.warmup):
        step()
    results.put("ready")
    while (steps := go[rank].get()) > 0:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            loss = step()
        dist.barrier()
        if holds_last:
            results.put((steps / (time.perf_counter() - start), loss))
    dist.destroy_process_group()


class TorchSide:
    """torch.distributed.pipelining ranks in their own processes, run a round at a time on request."""

    def __init__(self, args, schedule: str, virtual: int, stage_blocks):
        self._start(_torch_rank, args.ranks, (args, schedule, virtual, stage_blocks))

    def _start(self, target, world: int, settings: tuple) -> None:
        """``world`` processes running ``target(rank, world, port, *settings, go, results)``."""
        ctx = mp.get_context("spawn")
        self.go = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.procs = [
            ctx.Process(target=target, args=(r, world, port, *settings, self.go, self.results)) for r in range(world)
        ]
        for p in self.procs:
            p.start()
        for _ in self.procs:  # started, imported and warmed up before any round is timed
            assert self.results.get(timeout=600) == "ready"

    def run(self, steps: int) -> tuple[float, float]:
        for q in self.go:
            q.put(steps)
        return self.results.get(timeout=600)

    def close(self) -> None:
        for q in self.go:
            q.put(0)
        for p in self.procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join()


class SingleGpuSide:
    """The same model, batches, microbatching and optimizer, trained in this process on the GPU."""

    def __init__(self, model, batches, args):
        self.model = copy.deepcopy(model).cuda()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.batches = [(x.cuda(), y.cuda()) for x, y in batches]
        self.microbatches, self.next = args.microbatches, 0
        self.run(args.warmup)

    def run(self, steps: int) -> tuple[float, float]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            x, y = self.batches[self.next % len(self.batches)]
            self.next += 1
            chunks = zip(x.chunk(self.microbatches), y.chunk(self.microbatches))
            loss = sum(lm_loss(self.model(xm), ym) for xm, ym in chunks) / self.microbatches
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        last = float(loss.detach())
        torch.cuda.synchronize()
        return steps / (time.perf_counter() - start), last

    def close(self) -> None:
        pass


class CpuMeter:
    """CPU seconds (user + system, from /proc) that a set of processes spent, summed over the
    windows between ``start`` and ``stop``: on a host with fewer cores than processes, both sides'
    step rates follow the CPU each step costs, so the report shows where it went."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids
        self.spent = dict.fromkeys(pids, 0.0)
        self._at: dict[str, float] = {}

    def start(self) -> None:
        self._at = {k: _cpu_seconds(pid) for k, pid in self.pids.items()}

    def stop(self) -> None:
        for k, pid in self.pids.items():
            self.spent[k] += _cpu_seconds(pid) - self._at[k]

    def ms_per_step(self, steps: int) -> dict[str, float]:
        out = {k: round(v / steps * 1e3, 2) for k, v in self.spent.items()}
        return {**out, "total": round(sum(self.spent.values()) / steps * 1e3, 2)}


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def compare(client, model, batches, args, schedule: str, atoll_pids: dict[str, int]) -> dict:
    """atoll and its peer in alternating rounds: torch.distributed.pipelining on CPU, the same
    model in one process on the GPU. On CPU, the CPU each side's processes spent per step in
    the rounds of ``job.step`` (atoll: ``atoll_pids``) and of the peer is reported too."""
    virtual = args.virtual_stages if schedule == "interleaved_1f1b" else 1
    atoll = AtollSide(client, model, batches, args, schedule, virtual)
    if args.device == "cuda":
        peer, name, steps_key = SingleGpuSide(model, batches, args), "single_gpu", "single_gpu_steps_per_s"
    else:
        peer = TorchSide(args, schedule, virtual, atoll.stage_blocks)
        name, steps_key = "torch", "torch_pipelining_steps_per_s"
    cpu = CpuMeter(atoll_pids), CpuMeter({f"rank{r}": p.pid for r, p in enumerate(getattr(peer, "procs", []))})
    try:
        rounds, waiting = [], []
        for _ in range(args.rounds):
            cpu[0].start()
            a_rate, a_loss = atoll.run(args.steps)
            cpu[0].stop()
            waiting.append([m["waiting_s"] / m["wall_s"] for m in atoll.job.last.memory.values()])
            p_rate, _ = atoll.run(args.steps, pipelined=True)
            cpu[1].start()
            t_rate, t_loss = peer.run(args.steps)
            cpu[1].stop()
            if not rounds:  # same weights, same batches so far: the losses must agree
                first_round_losses = (a_loss, t_loss)
            rounds.append((a_rate, p_rate, t_rate))
    finally:
        report = atoll.job.plan.report
        memory = atoll.job.last.memory
        atoll.close()
        peer.close()
    row = {
        "schedule": schedule,
        "virtual_stages": virtual,
        "stage_blocks": atoll.stage_blocks,
        "transports": sorted({e["transport"] for e in report["edges"]}),
        "atoll_steps_per_s": round(median([a for a, _, _ in rounds]), 3),
        "atoll_async_steps_per_s": round(median([p for _, p, _ in rounds]), 3),
        steps_key: round(median([t for _, _, t in rounds]), 3),
        f"ratio_atoll_over_{name}": round(median([a / t for a, _, t in rounds]), 3),
        f"ratio_atoll_async_over_{name}": round(median([p / t for _, p, t in rounds]), 3),
        "ratio_per_round": [round(a / t, 3) for a, _, t in rounds],
        "ratio_async_per_round": [round(p / t, 3) for _, p, t in rounds],
        "first_round_loss_atoll": round(first_round_losses[0], 5),
        f"first_round_loss_{name}": round(first_round_losses[1], 5),
        "predicted_bubble_fraction": round(report["predicted_bubble_fraction"], 3),
        "measured_waiting_fraction_per_rank": [round(median(list(w)), 3) for w in zip(*waiting)],
        "predicted_memory_total_per_rank": [report["predicted_memory"][str(r)]["total"] for r in range(args.ranks)],
        "counted_memory_total_per_rank": [memory[r]["peak"]["total"] for r in range(args.ranks)],
    }
    if args.device == "cpu":
        row["atoll_cpu_ms_per_step"] = cpu[0].ms_per_step(args.rounds * args.steps)
        row["torch_cpu_ms_per_step"] = cpu[1].ms_per_step(args.rounds * args.steps)
    if args.device == "cuda":
        row["cuda_max_allocated_per_rank"] = [memory[r]["cuda_max_allocated"] for r in range(args.ranks)]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--virtual-stages", type=int, default=2, help="for interleaved_1f1b")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="alternating atoll/torch rounds per schedule")
    parser.add_argument("--steps", type=int, default=8, help="steps per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    args.threads = max(1, (os.cpu_count() or 1) // args.ranks)
    if args.device == "cuda" and args.threads > 4:
        args.threads = 4  # the GPU does the work; more host threads per worker only contend

    model, batches = make_setup(args)
    rows = []
    devices = ["cuda:0"] * args.ranks if args.device == "cuda" else None
    with (
        atoll.LocalCluster(workers=args.ranks, threads_per_worker=args.threads, devices=devices) as cluster,
        cluster.client() as client,
    ):
        for schedule in args.schedules.split(","):
            rows.append(compare(client, model, batches, args, schedule, process_pids(cluster)))
    print(
        json.dumps(
            {
                "benchmark": "pipeline",
                "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                "peer": "one process on the same GPU" if args.device == "cuda" else "torch.distributed.pipelining",
                "dtype": args.dtype,
                "block_size": args.block_size,
                "ranks": args.ranks,
                "microbatches": args.microbatches,
                "batch": args.batch,
                "model": f"gpt layers={args.layers} "
                f"d_model={args.d_model} params={sum(p.numel() for p in model.parameters())}",
                "rounds": args.rounds,
                "steps_per_round": args.steps,
                "warmup_steps": args.warmup,
                "threads_per_process": args.threads,
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "python": platform.python_version(),
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
