"""What the controller's state directory (--state-dir, docs/state-store.md) costs a training step.

    python bench/state_store.py                  # examples/train_gpt.py's job, 60 timed steps, 2 rounds
    python bench/state_store.py --steps 3 --rounds 1 --layers 1   # the smoke test's size

The same job as examples/train_gpt.py (4 stages, 1F1B, batch 32, 4 microbatches, AdamW) on a local
cluster without a state directory and on one with it, alternately, round after round, so the
machine's drift falls on both: once as a plain job (the store writes nothing per step) and once
with auto_resume (the store writes each step's journal entry, synced, beside the journal the
controller keeps in memory anyway; checkpoints are made rare so that they do not dominate). Two
runs of a job on a shared 2-core machine differ by a few percent, more than the store's cost, so
the store's one write per step is also timed by itself (the same StepRequest, appended to a
journal in a state directory on the same disk) and set against the step's time. Prints one JSON
object: steps/s of each, the ratios, and the journal write's share of a step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import atoll  # noqa: E402
from atoll._rpc import atoll_pb2 as pb  # noqa: E402
from atoll.controller.statedir import StateDir  # noqa: E402
from atoll.core.wire import tensor_to_pb  # noqa: E402
from examples.gpt import CharCorpus, GPTConfig, build_gpt, lm_loss  # noqa: E402

WARMUP_STEPS = 5


def steps_per_s(client, kind: str, args, scratch: Path) -> float:
    torch.manual_seed(0)
    corpus = CharCorpus()
    cfg = GPTConfig(vocab_size=corpus.vocab_size, n_layers=args.layers)
    data = torch.Generator().manual_seed(0)
    x, y = corpus.batch(args.batch, cfg.block_size, data)
    resume = {"auto_resume": True, "checkpoint_every": 10_000, "checkpoint_path": scratch / f"ckpt-{kind}"}
    job = client.pipeline(
        build_gpt(cfg), example_input=x, example_target=y, loss_fn=lm_loss, stages=4, microbatches=4,
        schedule="1f1b", optimizer="adamw", optimizer_args={"lr": 3e-3, "weight_decay": 0.0},
        **(resume if kind == "auto_resume" else {}),
    )  # fmt: skip
    batches = [corpus.batch(args.batch, cfg.block_size, data) for _ in range(WARMUP_STEPS + args.steps)]
    for b in batches[:WARMUP_STEPS]:
        job.step(*b)
    started = time.perf_counter()
    for b in batches[WARMUP_STEPS:]:
        job.step(*b)
    rate = args.steps / (time.perf_counter() - started)
    job.close()
    return rate


def journal_append_ms(args, scratch: Path, repeat: int = 200) -> float:
    """One journal entry of this job's step (its batch as the controller receives it), written and synced."""
    corpus = CharCorpus()
    x, y = corpus.batch(args.batch, GPTConfig(vocab_size=corpus.vocab_size).block_size, torch.Generator())
    request = pb.StepRequest(job_id="job0", inputs=[tensor_to_pb(x)], targets=[tensor_to_pb(y)], mode="train")
    store = StateDir(scratch / "journal-only")
    started = time.perf_counter()
    for seq in range(1, repeat + 1):
        store.journal_append("job0", seq, request, 1.0)
    took = (time.perf_counter() - started) / repeat
    store.close()
    return took * 1e3


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per job, after 5 warm-up steps")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    rates: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="atoll-bench-state-") as scratch:
        for round_ in range(args.rounds):
            for store in (False, True):
                state_dir = Path(scratch) / f"state-{round_}" if store else None
                with atoll.LocalCluster(workers=4, state_dir=state_dir) as cluster, cluster.client() as client:
                    for kind in ("plain", "auto_resume"):
                        name = f"{kind}_{'with' if store else 'without'}_store"
                        rates.setdefault(name, []).append(steps_per_s(client, kind, args, Path(scratch)))
        append_ms = journal_append_ms(args, Path(scratch))
    median = {name: statistics.median(r) for name, r in rates.items()}
    step_ms = 1e3 / median["auto_resume_without_store"]
    report = {
        "job": f"examples/train_gpt.py's GPT ({args.layers} layers), 4 stages 1F1B, batch {args.batch}, AdamW",
        "timed_steps": args.steps,
        "rounds": args.rounds,
        "steps_per_s": {name: [round(r, 2) for r in rs] for name, rs in rates.items()},
        "with_store_over_without": {
            kind: round(median[f"{kind}_with_store"] / median[f"{kind}_without_store"], 4)
            for kind in ("plain", "auto_resume")
        },
        "journal_append_ms": round(append_ms, 3),
        "auto_resume_step_ms_without_store": round(step_ms, 2),
        "journal_append_share_of_step": round(append_ms / step_ms, 4),
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
