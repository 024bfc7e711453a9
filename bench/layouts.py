"""Benchmark: the GPT example on 8 CPU workers under each parallel layout atoll builds, with the
bytes each step moves, next to torch.distributed.pipelining (pipeline only) and DDP (data
parallel only) on the same model, batch and process count. Prints one JSON object.

    python bench/layouts.py [--steps 6] [--rounds 2]
    python bench/layouts.py --workers 2 --layers 2 --d-model 16 --steps 1 --rounds 1   # smallest (smoke test)

With ``--workers N`` other than 8, only the two layouts that have a peer run: a pipeline of N
stages (next to torch.distributed.pipelining) and N data-parallel replicas (next to DDP).

Layouts (pipeline x tensor x data, ZeRO-1 or not, sequence-parallel or not): first those of the
sharded-stages issue's acceptance on as many workers as they take (TP2, TP2 with sequence
parallelism, DP2, DP2 ZeRO-1, PP2xTP2, PP2xDP2 ZeRO-1, PP2xTP2xDP2), then layouts of all 8
workers: 8x1x1, 4x1x2, 2x1x4, 1x1x8, 1x1x8 and 2x1x4 with ZeRO-1, 4x2x1, 2x4x1, 1x2x4,
2x2x2 with ZeRO-1, 2x2x2 with ZeRO-1 and sequence parallelism. Pipelines cut between whole
blocks (8 blocks: embedding, 6 layers, head), the same cuts on both sides. Every layout trains 8
microbatches of 4 rows per step (each replica takes 8/D of them) with SGD, so all do the same
arithmetic. Bytes are atoll's own per-step counts (``data_plane_bytes``, equal to the plan's
prediction): point-to-point bytes sent,
gradient bytes put into the replicas' all-reduces, and bytes put into the tensor-parallel islands'
all-reduces; for DDP the gradient bytes it all-reduces (every parameter, once a step) are given
the same way.

With ``--llama`` (transformers installed), a Hugging Face Llama of the same width and depth (4
heads over 2 key/value heads, rotary, SwiGLU) follows under TP2, TP2 with sequence parallelism
and, on 8 workers, PP2xTP2xDP2 with ZeRO-1: the layouts of the Llama tensor-parallel issue.

The machine this was written on has 2 cores for 8 workers: the figures compare layouts and
runtimes under that contention, not the layouts' speed on real hardware. atoll and its peer are
measured in alternating rounds while both stay up; nothing here asserts on time.
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

from dispatch import process_pids  # noqa: E402
from pipeline import CpuMeter, TorchSide, make_setup, median, serve_rounds  # noqa: E402

import atoll  # noqa: E402
from examples.gpt import CharCorpus, lm_loss  # noqa: E402

WORKERS = 8
MICROBATCHES = 8
# (pipeline, tensor, data, zero, sequence parallel)
LAYOUTS = [
    *[(1, 2, 1, 0, 0), (1, 2, 1, 0, 1), (1, 1, 2, 0, 0), (1, 1, 2, 1, 0), (2, 2, 1, 0, 0), (2, 1, 2, 1, 0)],
    (2, 2, 2, 0, 0),
    *[(8, 1, 1, 0, 0), (4, 1, 2, 0, 0), (2, 1, 4, 0, 0), (1, 1, 8, 0, 0), (1, 1, 8, 1, 0), (2, 1, 4, 1, 0)],
    *[(4, 2, 1, 0, 0), (2, 4, 1, 0, 0), (1, 2, 4, 0, 0), (2, 2, 2, 1, 0), (2, 2, 2, 1, 1)],
]


def _ddp_rank(rank, world, port, args, go, results):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    model, batches = make_setup(args)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    rows = args.batch // world
    index = 0

    def step() -> float:
        nonlocal index
        x, y = batches[index % len(batches)]
        index += 1
        loss = lm_loss(ddp(x[rank * rows : (rank + 1) * rows]), y[rank * rows : (rank + 1) * rows])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    serve_rounds(rank, go, results, step, args.warmup, reporter=rank == 0)


class DdpSide(TorchSide):
    """DDP on 8 processes (gloo), each on its 1/8 of every batch: the DP-only peer."""

    def __init__(self, args):
        self._start(_ddp_rank, args.ranks, (args,))


def blocks(args) -> int:
    """The GPT example's blocks, the units pipelines are cut between: embedding, layers, head."""
    return args.layers + 2


class LlamaLogits(torch.nn.Module):
    """A Hugging Face causal LM returning its logits alone."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids, use_cache=False).logits


def make_llama(args, vocab: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=args.d_model, intermediate_size=4 * args.d_model, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.block_size, use_cache=False,
    )  # fmt: skip
    return LlamaLogits(transformers.LlamaForCausalLM(config))


def gpt_split_points(args, pipeline: int) -> list:
    per = blocks(args) // pipeline
    return list(range(per, blocks(args), per))  # whole blocks, as torch's


def llama_split_points(args, pipeline: int) -> list:
    per = args.layers // pipeline
    return [f"lm.model.layers.{i}" for i in range(per, args.layers, per)]


def measure_atoll(
    client, model, batches, args, pipeline: int, tensor: int, data: int, zero: int, sequence: int, split_points
):
    x, y = batches[0]
    job = client.pipeline(
        model,
        example_input=x,
        example_target=y,
        loss_fn=lm_loss,
        stages=pipeline,
        microbatches=MICROBATCHES // data,
        split_points=split_points(args, pipeline),
        schedule="1f1b",
        optimizer="sgd",
        optimizer_args={"lr": 0.01},
        data_parallel=data,
        tensor_parallel=tensor,
        sequence_parallel=bool(sequence),
        zero=zero,
    )
    step = 0

    def run(steps: int) -> tuple[float, float]:
        nonlocal step
        start = time.perf_counter()
        sent = [batches[(step + i) % len(batches)] for i in range(steps)]
        if args.per_call > 1:  # Job.steps_async: per_call steps to a call
            futures = [f for i in range(0, steps, args.per_call) for f in job.steps_async(sent[i : i + args.per_call])]
        else:
            futures = [job.step_async(*batch) for batch in sent]
        step += steps
        loss = [f.result() for f in futures][-1]
        return steps / (time.perf_counter() - start), loss

    run(args.warmup)
    return job, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="steps per round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating atoll/peer rounds per layout")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--workers", type=int, default=WORKERS, help="8: every layout; else the two with a peer")
    parser.add_argument("--layers", type=int, default=6, help="GPT layers (pipelines cut between whole blocks)")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--per-call", type=int, default=1, help="atoll's steps sent to a call (Job.steps_async)")
    parser.add_argument(
        "--only", nargs="+", metavar="PxTxD", help="only these layouts, e.g. 1x1x8 8x1x1 (pp x tp x dp)"
    )
    parser.add_argument("--llama", action="store_true", help="then Llama under TP2, TP2+SP and PP2xTP2xDP2 ZeRO-1")
    args = parser.parse_args()
    # the other settings bench/pipeline.py's helpers read
    args.heads, args.block_size, args.dtype = 4, 64, "float32"
    args.batch, args.threads, args.microbatches, args.ranks = 32, 1, MICROBATCHES, args.workers
    layouts = LAYOUTS if args.workers == WORKERS else [(args.workers, 1, 1, 0, 0), (1, 1, args.workers, 0, 0)]
    if args.only:
        layouts = [x for x in layouts if "x".join(map(str, x[:3])) in args.only and not any(x[3:])]
    model, batches = make_setup(args)
    tokens = args.batch * args.block_size
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    runs = [("gpt", model, gpt_split_points, layout) for layout in layouts]
    if args.llama:
        llama = make_llama(args, -(-CharCorpus().vocab_size // 8) * 8)  # a vocabulary the islands divide
        llama_layouts = [(1, 2, 1, 0, 0), (1, 2, 1, 0, 1), (2, 2, 2, 1, 0)]
        runs += [("llama", llama, llama_split_points, x) for x in llama_layouts if x[0] * x[1] * x[2] <= args.workers]
    rows = []
    with atoll.LocalCluster(workers=args.workers, threads_per_worker=1) as cluster, cluster.client() as client:
        for name, net, split_points, (pipeline, tensor, data, zero, sequence) in runs:
            job, run = measure_atoll(client, net, batches, args, pipeline, tensor, data, zero, sequence, split_points)
            workers = pipeline * tensor * data
            peer, peer_name = None, None
            if workers < args.workers or tensor > 1 or name != "gpt":  # torch has no peer of the same layout here
                pass
            elif data == 1:
                per = blocks(args) // pipeline
                stage_blocks = [list(range(s * per, (s + 1) * per)) for s in range(pipeline)]
                peer, peer_name = TorchSide(args, "1f1b", 1, stage_blocks), "torch.distributed.pipelining 1F1B"
            elif pipeline == 1 and not zero:
                peer, peer_name = DdpSide(args), "DDP"
            ours, theirs = [], []
            peer_pids = {f"rank{r}": p.pid for r, p in enumerate(peer.procs)} if peer else {}
            cpu = CpuMeter(process_pids(cluster)), CpuMeter(peer_pids)
            for _ in range(args.rounds):
                cpu[0].start()
                ours.append(run(args.steps)[0])
                cpu[0].stop()
                if peer is not None:
                    cpu[1].start()
                    theirs.append(peer.run(args.steps)[0])
                    cpu[1].stop()
            moved = {w: m["data_plane_bytes"] for w, m in job.last.memory.items()}
            row = {
                "model": name,
                "layout": f"pp{pipeline} x tp{tensor} x dp{data}"
                + (" zero1" if zero else "")
                + (" sp" if sequence else ""),
                "workers": workers,
                "atoll_tokens_per_s": round(median(ours) * tokens),
                # with more processes than cores, the rates follow the CPU each step costs
                "atoll_cpu_ms_per_step": cpu[0].ms_per_step(args.rounds * args.steps)["total"],
                "bytes_per_step": {
                    "sent_total": sum(m["sent"] for m in moved.values()),
                    "all_reduced_total": sum(m["all_reduced"] for m in moved.values()),
                    "island_all_reduced_total": sum(m["island_all_reduced"] for m in moved.values()),
                    "max_sent_one_worker": max(m["sent"] for m in moved.values()),
                    "equals_prediction": all(  # worker (d * pipeline + r) * tensor + t runs rank r
                        m == job.plan.predicted_communication[(w // tensor) % pipeline] for w, m in moved.items()
                    ),
                },
            }
            if peer is not None:
                row["peer"] = peer_name
                row["peer_tokens_per_s"] = round(median(theirs) * tokens)
                row["ratio_atoll_over_peer"] = round(median(ours) / median(theirs), 2)
                row["peer_cpu_ms_per_step"] = cpu[1].ms_per_step(args.rounds * args.steps)["total"]
                if peer_name == "DDP":
                    row["peer_all_reduced_total"] = params * args.workers
                peer.close()
            job.close()
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    report = {
        "benchmark": "layouts",
        "device": "cpu",
        "workers": args.workers,
        "model": f"gpt layers={args.layers} d_model={args.d_model} params={params // 4}",
        "batch": f"{args.batch} x {args.block_size} tokens, {MICROBATCHES} microbatches",
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "rows": rows,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
