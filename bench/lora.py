"""Multi-tenant LoRA: adapter jobs sharing one resident base vs the same jobs trained separately.

Side by side on one local cluster (``--stages`` workers), the same tenants (LoRA adapters of
different targets on a Llama-shaped model from transformers, AdamW, 1F1B):

- shared: the base loaded once (``Client.load_base``), every tenant's adapter attached to it
  (``Client.lora``), all tenants training at once, each from its own thread; their steps run
  beside each other on the shared workers, one tenant's microbatches in another's bubbles;
- separate: each tenant a pipeline job of its own (the adapted model, base included), trained
  one after another, as without a resident base.

Prints JSON: tokens/s of each (training only; loading is listed apart), their ratio, the
parameter bytes the workers held for the tenants, how many cores each kept busy, and the ratios
the separate jobs' CPU per step would allow with every core busy, or with the busiest worker
never idle (the ceilings of any bubble filling on this host).

    python bench/lora.py                      # 4 tenants, 4 stages
    python bench/lora.py --steps 2 --hidden 32 --layers 2 --seq 8 --batch 4   # smallest
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dispatch import process_pids  # noqa: E402
from layouts import LlamaLogits  # noqa: E402
from pipeline import CpuMeter  # noqa: E402

import atoll  # noqa: E402
from atoll.client import lora  # noqa: E402
from examples.gpt import lm_loss  # noqa: E402

TARGETS = (["q_proj", "v_proj"], ["o_proj", "down_proj"], ["k_proj", "gate_proj", "up_proj"], ["q_proj", "up_proj"])


def build(args):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 32),
        num_key_value_heads=max(1, args.hidden // 64),
        max_position_embeddings=args.seq, use_cache=False,
    )  # fmt: skip
    model = LlamaLogits(transformers.LlamaForCausalLM(config))
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(0, args.vocab, (args.batch, args.seq), generator=g),) * 2
        for _ in range(args.steps + args.warmup)
    ]
    return model, batches


def _settings(args, batches):
    x, y = batches[0]
    return dict(
        example_input=x, example_target=y, loss_fn=lm_loss, microbatches=args.microbatches, schedule="1f1b",
        optimizer_args={"lr": 1e-3},
    )  # fmt: skip


def _train(job, batches, in_flight: int) -> list[float]:
    job.max_in_flight = in_flight
    return [f.result() for f in [job.step_async(x, y) for x, y in batches]]


def shared(client, model, batches, args, cpu: CpuMeter) -> dict:
    started = time.perf_counter()
    base = client.load_base(model, name="bench", stages=args.stages, **_settings(args, batches))
    jobs = []
    for t in range(args.tenants):
        torch.manual_seed(100 + t)  # each tenant's adapter starts as in the separate run
        targets = TARGETS[t % len(TARGETS)]
        jobs.append(client.lora(model, base="bench", rank=args.rank, targets=targets, **_settings(args, batches)))
    loaded = time.perf_counter() - started
    for job in jobs:
        _train(job, batches[: args.warmup], 1)
    losses: list[list[float]] = [[] for _ in jobs]

    def train(i):
        losses[i] = _train(jobs[i], batches[args.warmup :], args.in_flight)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(len(jobs))]
    started = time.perf_counter()
    cpu.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu.stop()
    wall = time.perf_counter() - started
    held = _held(jobs) + sum(base.plan.predicted_memory[r]["parameters"] for r in base.plan.predicted_memory)
    for job in jobs:
        job.close()
    base.close()
    return {"train_s": wall, "load_s": loaded, "parameter_bytes_held": held, "last_losses": [ls[-1] for ls in losses]}


def separate(client, model, batches, args, cpu: CpuMeter) -> dict:
    wall, loaded, held, last = 0.0, 0.0, 0, []
    for t in range(args.tenants):
        config = atoll.LoraConfig(rank=args.rank, alpha=float(args.rank), targets=tuple(TARGETS[t % len(TARGETS)]))
        started = time.perf_counter()
        torch.manual_seed(100 + t)
        job = client.pipeline(
            lora.with_adapters(model, config), stages=args.stages, optimizer="adamw", **_settings(args, batches)
        )
        loaded += time.perf_counter() - started
        _train(job, batches[: args.warmup], 1)
        started = time.perf_counter()
        cpu.start()
        last.append(_train(job, batches[args.warmup :], args.in_flight)[-1])
        cpu.stop()
        wall += time.perf_counter() - started
        held += _held([job])
        job.close()
    return {"train_s": wall, "load_s": loaded, "parameter_bytes_held": held, "last_losses": last}


def _held(jobs) -> int:
    """The parameter bytes the jobs' workers counted in their last step."""
    return sum(m["peak"]["parameters"] for job in jobs for m in job.last.memory.values())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="measured steps per tenant")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--in-flight", type=int, default=2, help="steps each tenant keeps sent ahead")
    args = parser.parse_args(argv)
    model, batches = build(args)
    tokens = args.tenants * args.steps * args.batch * args.seq
    with atoll.LocalCluster(workers=args.stages) as cluster, cluster.client() as client:
        meters = CpuMeter(process_pids(cluster)), CpuMeter(process_pids(cluster))
        together = shared(client, model, batches, args, meters[0])
        apart = separate(client, model, batches, args, meters[1])
    for side, meter in zip((together, apart), meters):
        side["tokens_per_s"] = tokens / side["train_s"]
        # on a host with fewer cores than workers, a pipeline's bubbles are other workers' CPU time
        side["cores_busy"] = sum(meter.spent.values()) / side["train_s"]
        side["cpu_ms_per_tenant_step"] = meter.ms_per_step(args.tenants * args.steps)
    busiest = max(v for k, v in apart["cpu_ms_per_tenant_step"].items() if k.startswith("worker"))
    result = {
        "model": {k: getattr(args, k) for k in ("hidden", "layers", "vocab", "seq", "batch", "microbatches", "rank")},
        "tenants": args.tenants,
        "stages": args.stages,
        "cpus": len(os.sched_getaffinity(0)),
        "shared_base": together,
        "separate_jobs": apart,
        "shared_vs_separate_tokens_per_s": together["tokens_per_s"] / apart["tokens_per_s"],
        "parameter_bytes_separate_vs_shared": apart["parameter_bytes_held"] / together["parameter_bytes_held"],
        # the most filling bubbles can give here, at the separate jobs' CPU per step: every core busy
        # (with fewer cores than workers, one worker's bubble is another's compute already), and
        # the busiest worker never idle
        "ratio_with_every_core_busy": len(os.sched_getaffinity(0)) / apart["cores_busy"],
        "ratio_with_busiest_worker_never_idle": apart["train_s"] * 1e3 / (args.tenants * args.steps) / busiest,
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
