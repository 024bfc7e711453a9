"""The physical limit of a pipeline on CPU: each rank's forward and backward work per microbatch,
with no runtime, no transfer and no bubble, measured in processes of their own under the malloc
settings atoll's daemons and the benchmarks' peers run with (``DAEMON_MALLOC``).

Measured two ways, both given by ``bench/pipeline.py``:

- ``alone``: one rank's process at a time, the machine otherwise idle: the figure the schedules
  issue defines (the slowest stage's F+B+W per microbatch times the microbatches).
- ``together``: every rank's process at once, each on its own work for the same window: what any
  pipeline on this machine pays, since its ranks compute at the same time and share the memory
  bandwidth and the last-level cache. On the 2-core machine this was written on, the MLP job's
  busiest rank (2 ranks) measured from 4% faster to 17% slower together than alone in three runs:
  the machine's own variation is as large.
"""

from __future__ import annotations

import statistics
import time

import torch
from peers import peer_context

WINDOW_S = 0.5
"""How long a rank repeats its work per measurement (at least 4 times); bench/pipeline.py
measures once per round, and takes the median over the rounds."""


def _rank_loop(setup, loss_fn, args, stage_blocks, mine, last, commands, results, rank):
    """One rank's process: on each command, forward and backward of each of its stages on one
    microbatch, repeated for ``window_s``; puts the median seconds of one repetition (the first
    one left out)."""
    torch.set_num_threads(args.threads)
    model, batches = setup(args)
    blocks = list(model.children())
    x, y = batches[0]
    h, target = x.chunk(args.microbatches)[0], y.chunk(args.microbatches)[0]
    inputs = {}
    with torch.no_grad():  # each stage's input: the microbatch through the stages before it
        for s, ids in enumerate(stage_blocks):
            inputs[s] = h
            for i in ids:
                h = blocks[i](h)
    stages = {s: torch.nn.Sequential(*[blocks[i] for i in stage_blocks[s]]) for s in mine}
    results.put((rank, None))  # ready
    while (window_s := commands.get()) is not None:
        runs: list[float] = []
        deadline = time.perf_counter() + window_s
        while len(runs) < 4 or time.perf_counter() < deadline:
            start = time.perf_counter()
            for s in mine:
                # the first stage's input is the batch: no stage upstream takes its gradient,
                # so no pipeline computes it: counting that product would set the limit too low
                inp = inputs[s].detach().requires_grad_(s > 0 and inputs[s].is_floating_point())
                out = stages[s](inp)
                (loss_fn(out, target) if s == last else out.float().pow(2).sum()).backward()
            runs.append(time.perf_counter() - start)
        results.put((rank, statistics.median(runs[1:])))


class RankCosts:
    """One process per rank, kept up so the limit can be measured again between a benchmark's
    rounds (the machine's speed drifts by tens of percent over minutes: a limit measured once,
    minutes from the rates it is set against, moved atoll's share of it by as much). Each
    ``measure`` returns the seconds of each rank's work per microbatch (its stages' forward and
    backward): ``(alone, together)``, each a list by rank."""

    def __init__(self, setup, loss_fn, args, stage_blocks, ranks_stages: list[list[int]]):
        ctx = peer_context()
        self.results = ctx.Queue()
        last = len(stage_blocks) - 1
        self.commands = [ctx.Queue() for _ in ranks_stages]
        self.procs = [
            ctx.Process(
                target=_rank_loop,
                args=(setup, loss_fn, args, stage_blocks, mine, last, self.commands[r], self.results, r),
            )
            for r, mine in enumerate(ranks_stages)
        ]
        for p in self.procs:
            p.start()
        try:
            for _ in self.procs:
                self.results.get(timeout=300)  # every process ready
        except BaseException:
            self.close()
            raise

    def measure(self, window_s: float = WINDOW_S) -> tuple[list[float], list[float]]:
        alone = {}
        for queue in self.commands:  # one at a time
            queue.put(window_s)
            alone.update([self.results.get(timeout=300)])
        for queue in self.commands:  # all at once
            queue.put(window_s)
        together = dict(self.results.get(timeout=300) for _ in self.procs)
        ranks = range(len(self.procs))
        return [alone[r] for r in ranks], [together[r] for r in ranks]

    def close(self) -> None:
        for queue, p in zip(self.commands, self.procs):
            if p.is_alive():
                queue.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
