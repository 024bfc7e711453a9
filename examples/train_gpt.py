"""Main job: train a small GPT-style character model across a 4-stage pipeline on a local cluster.

    python examples/train_gpt.py                  # 4 workers, 1F1B, 300 steps, 2 a call, 2 calls in flight
    python examples/train_gpt.py --schedule gpipe --steps 50
    python examples/train_gpt.py --schedule zbv --microbatches 8   # zero-bubble V: 2 chunks per worker
    python examples/train_gpt.py --schedule auto   # calibrate the candidates, keep the fastest predicted
    python examples/train_gpt.py --steps-per-call 1 --in-flight 1   # one step at a time, each awaited
    python examples/train_gpt.py --data-parallel 2   # 2 replicas of a 2-stage pipeline
    python examples/train_gpt.py --data-parallel 2 --zero   # ... with ZeRO-1
    python examples/train_gpt.py --data-parallel 2 --zero 3 --reshard-after-forward   # ZeRO-3, gathers per stage
    python examples/train_gpt.py --tensor-parallel 2 # 2 stages, each sharded over 2 workers
    python examples/train_gpt.py --tensor-parallel 2 --sequence-parallel   # ... with sequence parallelism
    python examples/train_gpt.py --workers 8 --tensor-parallel 2 --data-parallel 2 --zero   # PP2 x TP2 x DP2

Starts an embedded LocalCluster (a controller and 4 workers as subprocesses on 127.0.0.1),
submits the model as a pipeline, trains it with a progress bar (tqdm, when stderr is a terminal;
otherwise a line every 10% of the steps), prints the plan, the losses and a sample of generated
text, and stops every process it started.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import atoll  # noqa: E402
from atoll.core.names import SCHEDULE_CHOICES, V_SCHEDULES  # noqa: E402
from examples.gpt import CharCorpus, GPTConfig, build_gpt, lm_loss, sample  # noqa: E402


class Progress:
    """A tqdm bar on a terminal; in a log (stderr not a terminal), a plain line every ~10% of the
    steps and at the last one: step i/N, loss, steps/s, ETA."""

    def __init__(self, total: int):
        self.total, self.started = total, time.monotonic()
        self.every = max(1, total // 10)
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True)

    def line(self, step: int, loss: float) -> str:
        rate = step / max(time.monotonic() - self.started, 1e-9)
        eta = (self.total - step) / rate
        return f"step {step}/{self.total}  loss {loss:.3f}  {rate:.1f} steps/s  ETA {eta:.0f}s"

    def update(self, step: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            self.bar.update(1)
            if step == self.total:
                self.bar.close()
                print(self.line(step, loss), flush=True)  # the last step stays in the output, as in a log
        elif step % self.every == 0 or step == self.total:
            print(self.line(step, loss), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--workers", type=int, default=4, help="workers in all: stages x tensor-parallel x data-parallel degrees"
    )
    parser.add_argument("--tensor-parallel", type=int, default=1, help="workers per stage, the stage sharded over them")
    parser.add_argument(
        "--sequence-parallel", action="store_true", help="with --tensor-parallel: slice the sequence between its layers"
    )
    parser.add_argument(
        "--data-parallel", type=int, default=1, help="replicas of the pipeline, each on workers/N workers"
    )
    parser.add_argument(
        "--zero", type=int, nargs="?", const=1, default=0, choices=[0, 1, 2, 3],
        help="ZeRO stage over the replicas (1: optimizer state, 2: + gradients, 3: + parameters; --zero alone: 1)",
    )  # fmt: skip
    parser.add_argument(
        "--reshard-after-forward", action="store_true",
        help="with --zero 3: each stage (chunk) gathered per compute and freed after it, as FSDP2 does",
    )  # fmt: skip
    parser.add_argument(
        "--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: autocast, bfloat16 between stages"
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--steps-per-call", type=int, default=8,
        help="steps sent to the controller in one call (job.steps_async): the control plane's cost is paid per call",
    )  # fmt: skip
    parser.add_argument(
        "--in-flight", type=int, default=2,
        help="calls sent before the oldest one's losses are awaited (1: each call waits for the one before)",
    )  # fmt: skip
    parser.add_argument(
        "--schedule", default="1f1b", choices=SCHEDULE_CHOICES,
        help="auto: calibrate the candidates on the workers and keep the one predicted fastest",
    )  # fmt: skip
    parser.add_argument(
        "--virtual-stages", type=int, default=None, help="chunks per worker (default: 2 for zbv and dualpipev, else 1)"
    )
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.virtual_stages is None:
        args.virtual_stages = 2 if args.schedule in V_SCHEDULES else 1
    per_stage = args.data_parallel * args.tensor_parallel
    if args.data_parallel < 1 or args.tensor_parallel < 1 or args.workers % per_stage:
        parser.error(
            f"--data-parallel {args.data_parallel} x --tensor-parallel {args.tensor_parallel} "
            f"does not divide --workers {args.workers}"
        )
    if args.in_flight < 1 or args.steps_per_call < 1:
        parser.error("--in-flight and --steps-per-call: 1 or more")
    if args.reshard_after_forward and args.zero != 3:
        parser.error("--reshard-after-forward frees ZeRO-3's gathered parameters: give --zero 3")
    if args.zero and args.data_parallel < 2:
        parser.error("--zero shards model state over data-parallel replicas: give --data-parallel 2 or more")

    torch.manual_seed(args.seed)
    corpus = CharCorpus()
    cfg = GPTConfig(vocab_size=corpus.vocab_size, n_layers=args.layers)
    model = build_gpt(cfg)
    data = torch.Generator().manual_seed(args.seed)
    x, y = corpus.batch(args.batch, cfg.block_size, data)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"GPT: {len(model)} blocks, {params / 1e3:.0f}k parameters, vocab {cfg.vocab_size}, "
        f"context {cfg.block_size}; corpus {len(corpus.data)} characters"
    )

    started = time.monotonic()
    with atoll.LocalCluster(workers=args.workers) as cluster, cluster.client() as client:
        print(
            f"local cluster: controller {cluster.address}, {args.workers} workers "
            f"(up in {time.monotonic() - started:.1f}s)"
        )
        job = client.pipeline(
            model,
            example_input=x,
            example_target=y,
            loss_fn=lm_loss,
            stages=args.workers // per_stage,
            data_parallel=args.data_parallel,
            tensor_parallel=args.tensor_parallel,
            sequence_parallel=args.sequence_parallel,
            zero=args.zero,
            reshard_after_forward=args.reshard_after_forward,
            precision=args.precision,
            microbatches=args.microbatches,
            schedule=args.schedule,
            virtual_stages=args.virtual_stages,
            optimizer="adamw",
            optimizer_args={"lr": args.lr, "weight_decay": 0.0},
            name="gpt-char",
        )
        print(job.plan.render())
        losses = []
        t0 = time.monotonic()
        progress = Progress(args.steps)
        # Steps go out a few to a call, and the next call before the last one's losses are back:
        # the workers stay busy while losses travel back and the next steps are dispatched, and
        # the control plane's per-call cost is shared by the call's steps. Steps still run one
        # at a time in order, each on the weights the one before left: the losses are those of
        # `--steps-per-call 1 --in-flight 1`, one synchronous step after another.
        sent: collections.deque = collections.deque()
        job.max_in_flight = max(job.max_in_flight, args.in_flight)
        while len(losses) < args.steps:
            unsent = args.steps - len(losses) - len(sent)
            if unsent and len(sent) <= (args.in_flight - 1) * args.steps_per_call:  # room for a call
                count = min(args.steps_per_call, unsent)
                batches = [corpus.batch(args.batch, cfg.block_size, data) for _ in range(count)]
                sent.extend(job.steps_async(batches) if len(batches) > 1 else [job.step_async(*batches[0])])
                continue
            losses.append(sent.popleft().result())
            progress.update(len(losses), losses[-1])
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        print(
            f"loss: first 5 steps {first:.3f} -> last 5 steps {last:.3f} "
            f"({args.steps / (time.monotonic() - t0):.1f} steps/s)"
        )
        measured = job.last.memory  # per worker: replica 0's rank r, island rank 0 is worker r * T
        for rank, predicted in sorted(job.plan.predicted_memory.items()):
            worker = rank * args.tensor_parallel
            moved, expected = measured[worker]["data_plane_bytes"], job.plan.predicted_communication[rank]
            print(
                f"  rank {rank}: predicted peak {predicted['total'] / 2**20:.2f} MiB, "
                f"measured {measured[worker]['peak']['total'] / 2**20:.2f} MiB; "
                "bytes sent/received/all-reduced/island-reduced "
                f"predicted {expected['sent']}/{expected['received']}/{expected['all_reduced']}/"
                f"{expected['island_all_reduced']}, measured {moved['sent']}/{moved['received']}/"
                f"{moved['all_reduced']}/{moved['island_all_reduced']}"
            )
        model.load_state_dict(job.state_dict())
        job.close()
    print(
        "sample:",
        sample(model, corpus, "The keeper ", 120, cfg.block_size, torch.Generator().manual_seed(1)).replace("\n", " "),
    )
    print(f"total {time.monotonic() - started:.1f}s")
    if not last < first:
        raise SystemExit("loss did not fall")


if __name__ == "__main__":
    main()
