"""Benchmark: atoll's ZeRO-3 next to FSDP2 (``fully_shard``) on the same model, ranks and batch.

Both sides train the GPT example (examples/gpt.py) from the same initial weights with AdamW, on
``--workers`` CPU processes over gloo, each process taking 1/workers of every batch in one
microbatch. FSDP2 wraps every block and then the root (its usual per-block units, resharded after
forward, its default); atoll runs ``data_parallel=workers, zero=3`` on one pipeline stage, gathering
the rank's parameters once per step, or, with ``--reshard-after-forward``, cut into ``--layers``
units (``virtual_stages``), each gathered before each of its computes and freed after it. The two
are measured in alternating rounds while both sets of processes stay up. Prints one JSON object:
tokens/s per side and their ratio (above 1: atoll faster), and per rank the model state held at the optimizer step
(parameters, gradients, optimizer state: atoll's own count, and FSDP2's local shards summed the
same way) and the growth of the process's peak resident memory over training (VmHWM after the
steps less VmRSS once the model is built and sharded, or the job loaded; peaks reset through
/proc/PID/clear_refs), which counts activations, gathered parameters and every temporary alike
on both sides.

    python bench/zero.py [--workers 4] [--steps 6] [--rounds 3] [--reshard-after-forward]
    python bench/zero.py --workers 2 --layers 1 --d-model 16 --steps 1 --rounds 1   # smallest (smoke test)

Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline import TorchSide, make_setup, median, serve_rounds  # noqa: E402

import atoll  # noqa: E402
from examples.gpt import lm_loss  # noqa: E402

ADAMW = {"lr": 1e-3, "weight_decay": 0.01}


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss(pid: int) -> int:
    """Reset the process's peak resident memory to its current one; returns that, in bytes."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _status_kib(pid, "VmRSS") * 1024


def peak_rss(pid: int) -> int:
    return _status_kib(pid, "VmHWM") * 1024


def _tensor_bytes(tensors) -> int:
    out = 0
    for t in tensors:
        if t is not None:
            t = t.to_local() if hasattr(t, "to_local") else t
            out += t.numel() * t.element_size()
    return out


def _fsdp_rank(rank, world, port, args, go, results):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip
    model, batches = make_setup(args)
    mesh = init_device_mesh("cpu", (world,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    baseline = reset_peak_rss(os.getpid())  # the model built and sharded; training from here
    rows = args.batch // world
    index, model_state = 0, {}

    def step() -> float:
        nonlocal index, model_state
        x, y = batches[index % len(batches)]
        index += 1
        loss = lm_loss(model(x[rank * rows : (rank + 1) * rows]), y[rank * rows : (rank + 1) * rows])
        loss.backward()
        opt.step()
        params = list(model.parameters())
        model_state = {
            "parameters": _tensor_bytes(params),
            "gradients": _tensor_bytes(p.grad for p in params),
            "optimizer": _tensor_bytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)),
        }
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(reduced := loss.detach().clone())
        return reduced.item() / world

    def memory() -> list[dict]:  # every rank's, gathered
        gathered = [None] * world
        dist.all_gather_object(gathered, {"at_step": model_state, "peak_rss_growth": peak_rss(os.getpid()) - baseline})
        return gathered

    serve_rounds(rank, go, results, step, args.warmup, reporter=rank == 0, extra=memory)


class FsdpSide(TorchSide):
    """FSDP2 on ``workers`` processes (gloo), each on its 1/workers of every batch."""

    def __init__(self, args):
        self._start(_fsdp_rank, args.workers, (args,))


class AtollSide:
    def __init__(self, client, cluster, model, batches, args):
        self.batches, self.next = batches, 0
        self.pids = [p.pid for p in cluster.workers]
        x, y = batches[0]
        units = {}
        if args.reshard_after_forward:  # a unit per block, as FSDP2's side wraps them
            units = dict(virtual_stages=args.layers, schedule="interleaved_1f1b", reshard_after_forward=True)
        self.job = client.pipeline(
            model, example_input=x, example_target=y, loss_fn=lm_loss, stages=1, microbatches=1,
            optimizer="adamw", optimizer_args=ADAMW, data_parallel=args.workers, zero=3, **units,
        )  # fmt: skip
        self.baseline = [reset_peak_rss(pid) for pid in self.pids]  # the job loaded; training from here
        self.run(args.warmup)

    def run(self, steps: int):
        start = time.perf_counter()
        for _ in range(steps):
            loss = self.job.step(*self.batches[self.next % len(self.batches)])
            self.next += 1
        rate = steps / (time.perf_counter() - start)
        # the job uses every worker of the cluster: its RSS figures are per worker (the cluster's
        # order), the counted ones per replica
        memory = {
            "per_replica": [
                {
                    "at_step": {k: m["at_step"][k] for k in ("parameters", "gradients", "optimizer")},
                    "peak_counted": m["peak"]["total"],
                }
                for _, m in sorted(self.job.last.memory.items())
            ],
            "peak_rss_growth_per_worker": [peak_rss(pid) - base for pid, base in zip(self.pids, self.baseline)],
        }
        return rate, loss, memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6, help="steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--reshard-after-forward", action="store_true", help="atoll gathers per unit (one per layer), as FSDP2 does"
    )
    args = parser.parse_args()
    args.model, args.dtype = "gpt", "float32"
    if args.batch % args.workers:
        parser.error("--batch must divide among --workers")
    model, batches = make_setup(args)
    rounds = []
    with atoll.LocalCluster(workers=args.workers, threads_per_worker=1) as cluster, cluster.client() as client:
        ours = AtollSide(client, cluster, model, batches, args)
        theirs = FsdpSide(args)
        try:
            for _ in range(args.rounds):
                rounds.append((ours.run(args.steps), theirs.run(args.steps)))
        finally:
            ours.job.close()
            theirs.close()
    tokens = args.batch * args.block_size
    params = sum(p.numel() for p in model.parameters())
    (_, a_loss, a_memory), (_, f_loss, f_memory) = rounds[-1]
    print(
        json.dumps(
            {
                "benchmark": "zero",
                "model": f"gpt layers={args.layers} d_model={args.d_model} params={params}",
                "workers": args.workers,
                "atoll_reshard_after_forward": args.reshard_after_forward,
                "batch": args.batch,
                "block_size": args.block_size,
                "optimizer": "adamw",
                "rounds": args.rounds,
                "steps_per_round": args.steps,
                "atoll_zero3_tokens_per_s": round(median([a[0] for a, _ in rounds]) * tokens, 1),
                "fsdp2_tokens_per_s": round(median([f[0] for _, f in rounds]) * tokens, 1),
                "ratio_atoll_over_fsdp2": round(median([a[0] / f[0] for a, f in rounds]), 3),
                "ratio_per_round": [round(a[0] / f[0], 3) for a, f in rounds],
                "last_loss": {"atoll": round(a_loss, 5), "fsdp2": round(f_loss, 5)},
                "atoll_zero3": a_memory,
                "fsdp2_per_rank": f_memory,
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
