"""Benchmark: atoll pipelines vs torch.distributed.pipelining, side by side in one run.

    python bench/pipeline.py                      # every schedule both sides have, on CPU/gloo
    python bench/pipeline.py --schedules gpipe --steps 20
    python bench/pipeline.py --model mlp --ranks 2 --batch 256   # the MLP job at 2 stages
    python bench/pipeline.py --device cuda        # 4 workers on one GPU vs one process on it

Schedules: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-H2, ZBV and DualPipeV, each run by atoll and
by torch's own class for it (ZB-H1 is torch's ScheduleInterleavedZeroBubble at one stage per rank;
torch has no ZB-H2, so its row runs torch's ZB-H1, named in ``torch_schedule``). ``best``
compares each side's fastest schedule, as a user picking one would (and, in
``best.by_share_of_limit``, each side's schedule with the largest share of the physical limit
measured beside it, among the schedules with a stage per rank, which share their stages and so
their limit: the rows run minutes apart, and the machine's drift between them cancels);
``best.contended_limit_over_torch`` is what a schedule running at the contended limit (below)
would show against torch's best, read in the rounds of torch's best row: with a core per rank,
about the most any schedule of the same arithmetic could show. ``best.head_to_head`` runs each
side's two fastest schedules again in alternating rounds beside each other, each round counting
each side's faster, so the drift between rows does not enter the best-against-best ratio.
``auto`` (atoll alone: torch has no such schedule) reports what ``schedule="auto"`` chose after
calibrating, its predicted step time against the measured one, and the measured rate of each
candidate the run also measured. On CPU each row also gives the physical limit: the busiest
rank's forward and backward work per microbatch times the microbatches, as steps per second, and
atoll's share of it; measured with each rank's work in a process alone, and again with all
ranks' at once (``contended_limit``: what the ranks pay for sharing the machine's memory and
cache; bench/stage_limit.py), with each side's share of that (atoll's with steps waited for,
sent ahead and several to a call).
The limit is measured in every round, after the two sides' rates, and each share is the median
of the rounds' own (rate / that round's limit), so the machine's drift over minutes cancels.
Beside the limit's figures per microbatch, ``atoll_compute_ms_per_microbatch_per_rank`` gives the
same work as it ran inside atoll's pipeline (the resident round): each rank's compute spans
of the round's steps, less the receive waits inside them, over the microbatches (the optimizer's
step apart, ``atoll_optimizer_ms_per_step_per_rank``). Where it exceeds the limit's figure, the
same forward and backward ran slower inside the pipeline than alone: the share of the limit lost
there is lost in the kernels (the ranks sharing the cores' caches and the memory), not in waits.

On CPU, both sides train the same GPT-style model (examples/gpt.py), or with ``--model mlp`` an MLP
(8 x Linear(1024, 1024) + GELU, then a head), from the same initial weights, with the same stage
boundaries (whole blocks, as many to each stage where they divide evenly), the same
microbatches, the same number of processes (one per pipeline rank, gloo between them) and the
same intra-op threads per process.

Small shared machines are noisy, so the two are measured in alternating rounds while both sets of
processes stay up (atoll, torch, atoll, torch, ...): each round gives a ratio, and the report
gives per-round ratios and their median. Prints one JSON object; ratio = atoll / torch steps per
second (above 1 means atoll is faster). atoll is measured four times per round: with ``job.step``
(each step waits for the previous), with ``job.step_async`` (a round's steps are all sent
before waiting, as a Pathways client would), with ``job.steps_async`` (``--steps-per-call``
steps to a call, the next call sent while one runs, as examples/train_gpt.py trains), and so
again on the same batches held by the workers that read them (``job.put_batch``, placed once:
``atoll_resident``), as torch's ranks hold theirs, so that no step carries a batch; that
round's rate is also read as a long run's (``atoll_resident_steady``: from its first call's end to
its last call's, at least two calls a round), since torch's ranks time their rounds between two
barriers of their own, with no call's way in or out inside them. On CPU the
report also gives the CPU milliseconds each side's processes spent per step (atoll's client,
controller and workers; torch's ranks): with more processes than cores, the rates follow it.
Nothing here asserts on time.

With ``--device cuda`` the peer is the same model trained in one process on the same GPU (same
microbatches, optimizer and batches; no pipeline, so no bubble): ratio = atoll / single process.
The atoll workers all share that GPU and talk over CUDA IPC; by default (``--mps auto``, as
``LocalCluster``) they share it through a CUDA MPS daemon of the cluster's own where the driver
ships one, so their kernels overlap instead of taking turns; ``--mps off`` measures them taking
turns (the single process is no MPS client: it has the GPU to itself). ``cuda_mps`` in the report
says which ran. The report adds each rank's measured waiting fraction (time blocked on the data
plane over the step's wall time).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import queue
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dispatch import _cpu_seconds, process_pids  # noqa: E402
from peers import peer_context  # noqa: E402
from stage_limit import WINDOW_S, RankCosts  # noqa: E402

import atoll  # noqa: E402
from atoll.client.calibrate import calibration_configs  # noqa: E402
from atoll.core.config import JobConfig, layout_name  # noqa: E402
from atoll.core.names import V_SCHEDULES  # noqa: E402
from atoll.core.spans import WAIT  # noqa: E402
from examples.gpt import CharCorpus, GPTConfig, build_gpt, lm_loss  # noqa: E402

TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zb_h1": "ScheduleInterleavedZeroBubble",  # its ZB1P, at one stage per rank
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
MULTI_STAGE = {"interleaved_1f1b", "zb_h1", "zbv", "dualpipev"}
"""torch's schedules that take a list of stages (one for ZB-H1)."""
TORCH_NEAREST = {"zb_h2": "zb_h1"}
"""What torch runs beside an atoll schedule it does not ship: ZB-H2's row measures torch's ZB-H1
(ZB-H2 is ZB-H1 given more memory)."""
MLP_WIDTH, MLP_BLOCKS, MLP_OUT = 1024, 8, 16


def virtual_stages(args, schedule: str) -> int:
    return {"interleaved_1f1b": args.virtual_stages, "zbv": 2, "dualpipev": 2}.get(schedule, 1)


def stage_ids(rank: int, world: int, schedule: str, virtual: int) -> list[int]:
    """The stages a rank holds: interleaved (rank + k * world), or a V for ZBV and DualPipeV."""
    if schedule in V_SCHEDULES:
        return [rank, 2 * world - 1 - rank]
    return [rank + k * world for k in range(virtual)]


def mlp_loss(out, target):
    return torch.nn.functional.mse_loss(out, target)


def loss_of(args):
    return mlp_loss if getattr(args, "model", "gpt") == "mlp" else lm_loss


def make_setup(args):
    if getattr(args, "model", "gpt") == "mlp":
        return make_mlp(args)
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


def make_mlp(args):
    """The MLP job: 8 blocks of Linear(1024, 1024) + GELU, the last with a head to 16 outputs
    (mean squared error against random targets); 16 batches of ``args.batch`` rows."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(MLP_WIDTH, MLP_WIDTH), torch.nn.GELU()) for _ in range(MLP_BLOCKS)]
    blocks[-1].append(torch.nn.Linear(MLP_WIDTH, MLP_OUT))
    model = torch.nn.Sequential(*blocks).to(getattr(torch, args.dtype))
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(args.batch, MLP_WIDTH, generator=g), torch.randn(args.batch, MLP_OUT, generator=g))
        for _ in range(16)
    ]
    return model, [(x.to(model[0][0].weight.dtype), y.to(model[0][0].weight.dtype)) for x, y in batches]


def even_split_points(model, chunks: int) -> list[str] | None:
    """Cuts between whole blocks, the same number in each chunk, so torch's stages can be built
    from the same blocks; None (atoll's cost-balanced split) when the chunks do not divide them."""
    blocks = len(list(model.children()))
    if blocks % chunks:
        return None
    per = blocks // chunks
    return [str(i) for i in range(per, blocks, per)]


ATOLL_SIDES = {
    "atoll": "ratio_per_round",
    "atoll_async": "ratio_async_per_round",
    "atoll_per_call": "ratio_per_call_per_round",
    "atoll_resident": "ratio_resident_per_round",
    "atoll_resident_steady": "ratio_resident_steady_per_round",
}
"""atoll's ways of running a round (steps waited for, sent ahead, several to a call, and several
to a call on batches held by the workers, whose rate is also read from its first call's end, see
``AtollSide.run``), each with its report key of per-round ratios."""


def steady_round_steps(args) -> int:
    """Steps of a round whose ``AtollSide.steady_rate`` is read: two calls at least, so that a
    rate from the first call's end to the last's exists."""
    return max(args.steps, 2 * args.steps_per_call)


class AtollSide:
    def __init__(
        self,
        client,
        model,
        batches,
        args,
        schedule: str,
        virtual: int,
        microbatches: int = 0,
        even_split: bool = True,
        **auto_layouts,
    ):
        """``microbatches``: the job's count, if not ``--microbatches``; ``even_split``: cut the
        stages between whole blocks, as torch's are (``even_split_points``), else by cost;
        ``auto_layouts``: the other layouts ``schedule="auto"`` may choose (``auto_microbatches``,
        ``auto_virtual_stages``)."""
        x, y = batches[0]
        self.job = client.pipeline(
            model,
            example_input=x,
            example_target=y,
            loss_fn=loss_of(args),
            stages=args.ranks,
            microbatches=microbatches or args.microbatches,
            schedule=schedule,
            virtual_stages=virtual,
            optimizer="sgd",
            optimizer_args={"lr": 0.01},
            device=args.device,
            split_points=even_split_points(model, args.ranks * virtual) if even_split else None,
            **auto_layouts,
        )
        self.batches, self.args, self.next = batches, args, 0
        # the same batches placed once on the workers that read them (input on the first rank,
        # target on the last), as torch's ranks hold theirs: the resident rounds step on these
        self.resident = [self.job.put_batch(x, y) for x, y in batches]
        # which blocks each stage holds, for torch's stages and the limit; cut by cost, a stage may
        # start inside a block ("1.ln1"), which neither uses
        stages = self.job.plan.report["stages"]
        self.stage_blocks = [[int(b) for b in s["modules"]] for s in stages] if even_split else None
        self.run(args.warmup)

    def run(
        self, steps: int, pipelined: bool = False, per_call: int = 0, resident: bool = False
    ) -> tuple[float, float]:
        """Returns (steps per second, last loss). ``pipelined`` sends every step of the round
        before waiting (step_async), so the controller dispatches step k+1 while k runs.
        ``per_call`` sends the steps ``per_call`` to a call (steps_async), the next call sent
        while one runs, as examples/train_gpt.py does: each worker runs a call's steps in one
        turn, so the control plane's cost per call is shared by its steps. ``resident`` steps on
        the batches the workers hold (``Job.put_batch``): no step carries a batch's bytes.
        With ``per_call``, ``steady_rate`` is left the rate of the steps after the first call, from
        its end to the last call's (None for one call): a long run's, whose first call's way in
        and out is paid once, not once a round."""
        start = time.perf_counter()
        futures = []
        first_end, self.steady_rate = None, None
        batches = self.resident if resident else self.batches
        for done in range(0, steps, per_call or 1):
            chunk = []
            for _ in range(min(per_call or 1, steps - done)):
                chunk.append(batches[self.next % len(batches)])
                self.next += 1
            if per_call:
                futures.append(self.job.steps_async(chunk)[-1])
                if len(futures) > 1:
                    futures[-2].result()
                    first_end = first_end or time.perf_counter()
            else:
                futures.append(self.job.step_async(*chunk[0]))
                if not pipelined:
                    futures[-1].result()
        loss = [f.result() for f in futures][-1]
        end = time.perf_counter()
        if first_end is not None:
            self.steady_rate = (steps - per_call) / (end - first_end)
        return steps / (end - start), loss

    def steady_round(self, resident: bool = False) -> tuple[float, float]:
        """A round of ``--steps-per-call`` steps to a call, two calls at least
        (``steady_round_steps``): its rate, and its rate from the first call's end (``steady_rate``)."""
        rate, _ = self.run(steady_round_steps(self.args), per_call=self.args.steps_per_call, resident=resident)
        return rate, self.steady_rate

    def close(self) -> None:
        for x, y in self.resident:
            x.free()
            y.free()
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
    mine = stage_ids(rank, world, schedule, virtual)
    stages = [
        pipelining.PipelineStage(
            torch.nn.Sequential(*[blocks[i] for i in stage_blocks[s]]), s, num_stages, torch.device("cpu")
        )
        for s in mine
    ]
    for stage in stages:
        _without_sends_to_itself(stage, rank)
    opt = torch.optim.SGD([p for st in stages for p in st.submod.parameters()], lr=0.01)
    cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
    sched = cls(stages if schedule in MULTI_STAGE else stages[0], args.microbatches, loss_fn=loss_of(args))
    holds_first, holds_last = 0 in mine, num_stages - 1 in mine
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

    serve_rounds(rank, go, results, step, args.warmup, reporter=holds_last)


def _without_sends_to_itself(stage, rank: int) -> None:
    """torch before 2.13 opens a multi-stage schedule's links with a send and a receive between
    each pair of neighbouring stages, a V's turn too, where both stages sit on one rank; gloo
    cannot pair a rank with itself ("Pair is not connected", torch 2.11), and torch 2.13 opens
    them another way. The stages on one rank hand over in memory: those sends are left out."""
    opening = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if opening is not None:
        stage._get_init_p2p_neighbors_ops = lambda: [op for op in opening() if op.peer != rank]


def serve_rounds(rank: int, go, results, step, warmup: int, reporter: bool, extra=None) -> None:
    """A peer rank's life after setup: ``warmup`` steps, "ready", then for each request of n
    steps, the n steps between two barriers; the ``reporter`` rank puts (steps/s, its last loss),
    plus ``extra()`` where given (called on every rank: it may be a collective). Ends the group."""
    for _ in range(warmup):
        step()
    results.put("ready")
    while (steps := go[rank].get()) > 0:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            loss = step()
        dist.barrier()
        rate = steps / (time.perf_counter() - start)
        more = () if extra is None else (extra(),)
        if reporter:
            results.put((rate, loss, *more))
    dist.destroy_process_group()


class TorchSide:
    """torch.distributed.pipelining ranks in their own processes, run a round at a time on request."""

    def __init__(self, args, schedule: str, virtual: int, stage_blocks):
        self._start(_torch_rank, args.ranks, (args, schedule, virtual, stage_blocks))

    def _start(self, target, world: int, settings: tuple) -> None:
        """``world`` processes running ``target(rank, world, port, *settings, go, results)``."""
        ctx = peer_context()
        self.go = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.procs = [
            ctx.Process(target=target, args=(r, world, port, *settings, self.go, self.results)) for r in range(world)
        ]
        for p in self.procs:  # under the malloc settings LocalCluster gives atoll's daemons (bench/peers.py)
            p.start()
        for _ in self.procs:  # started, imported and warmed up before any round is timed
            assert self._result(600) == "ready"

    def _result(self, timeout_s: float):
        """The next result, or an error as soon as a rank has died (not the whole deadline)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                return self.results.get(timeout=1)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if p.exitcode not in (None, 0)]
                if dead:
                    codes = [self.procs[r].exitcode for r in dead]
                    for p in self.procs:  # the others may wait on the dead one in a collective
                        p.kill()
                    raise RuntimeError(f"torch rank(s) {dead} exited with {codes}") from None
        raise TimeoutError(f"no result from the torch ranks in {timeout_s:g}s")

    def run(self, steps: int) -> tuple[float, float]:
        for q in self.go:
            q.put(steps)
        return self._result(600)

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
    virtual = virtual_stages(args, schedule)
    torch_schedule = TORCH_NEAREST.get(schedule, schedule)  # on CPU: what torch runs beside it
    atoll = AtollSide(client, model, batches, args, schedule, virtual)
    if args.device == "cuda":
        peer, name, steps_key = SingleGpuSide(model, batches, args), "single_gpu", "single_gpu_steps_per_s"
    else:
        peer = TorchSide(args, torch_schedule, virtual, atoll.stage_blocks)
        name, steps_key = "torch", "torch_pipelining_steps_per_s"
    cpu = CpuMeter(atoll_pids), CpuMeter({f"rank{r}": p.pid for r, p in enumerate(getattr(peer, "procs", []))})
    limit, limits = None, []  # on CPU: the physical limit, measured in every round beside the rates
    try:
        if args.device == "cpu":
            ranks_stages = [stage_ids(r, args.ranks, schedule, virtual) for r in range(args.ranks)]
            limit = RankCosts(make_setup, loss_of(args), args, atoll.stage_blocks, ranks_stages)
        rounds, waiting, work = [], [], []
        for _ in range(args.rounds):
            cpu[0].start()
            a_rate, a_loss = atoll.run(args.steps)
            cpu[0].stop()
            waiting.append([m["waiting_s"] / m["wall_s"] for m in atoll.job.last.memory.values()])
            p_rate, _ = atoll.run(args.steps, pipelined=True)
            c_rate, _ = atoll.run(args.steps, per_call=args.steps_per_call)
            r_rate, s_rate = atoll.steady_round(resident=True)
            if args.device == "cpu":  # the round closest to the limit: no batch crosses the cores
                timeline = atoll.job.timeline(last=steady_round_steps(args))
                work.append(compute_per_rank(timeline, args.microbatches))
            cpu[1].start()
            t_rate, t_loss = peer.run(args.steps)
            cpu[1].stop()
            if limit is not None:
                limits.append(limit.measure(args.limit_window_s))
            if not rounds:  # same weights, same batches so far: the losses must agree
                first_round_losses = (a_loss, t_loss)
            rounds.append(
                {
                    "atoll": a_rate,
                    "atoll_async": p_rate,
                    "atoll_per_call": c_rate,
                    "atoll_resident": r_rate,
                    "atoll_resident_steady": s_rate,
                    "peer": t_rate,
                }
            )
    finally:
        report = atoll.job.plan.report
        memory = atoll.job.last.memory
        atoll.close()
        peer.close()
        if limit is not None:
            limit.close()
    row = {
        "schedule": schedule,
        "virtual_stages": virtual,
        "stage_blocks": atoll.stage_blocks,
        "transports": sorted({e["transport"] for e in report["edges"]}),
        steps_key: round(median([r["peer"] for r in rounds]), 3),
        "first_round_loss_atoll": round(first_round_losses[0], 5),
        f"first_round_loss_{name}": round(first_round_losses[1], 5),
        "predicted_bubble_fraction": round(report["predicted_bubble_fraction"], 3),
        "measured_waiting_fraction_per_rank": [round(median(list(w)), 3) for w in zip(*waiting)],
        "predicted_memory_total_per_rank": [report["predicted_memory"][str(r)]["total"] for r in range(args.ranks)],
        "counted_memory_total_per_rank": [memory[r]["peak"]["total"] for r in range(args.ranks)],
    }
    for side, per_round in ATOLL_SIDES.items():  # each of atoll's ways against the peer
        row[f"{side}_steps_per_s"] = round(median([r[side] for r in rounds]), 3)
        row[f"ratio_{side}_over_{name}"] = round(median([r[side] / r["peer"] for r in rounds]), 3)
        row[per_round] = [round(r[side] / r["peer"], 3) for r in rounds]
    if args.device == "cpu":
        row["torch_schedule"] = torch_schedule
        row["atoll_cpu_ms_per_step"] = cpu[0].ms_per_step(args.rounds * args.steps)
        for i, key in enumerate(("atoll_compute_ms_per_microbatch_per_rank", "atoll_optimizer_ms_per_step_per_rank")):
            row[key] = [round(median([w[r][i] for w in work]) * 1e3, 2) for r in range(args.ranks)]
        row["torch_cpu_ms_per_step"] = cpu[1].ms_per_step(args.rounds * args.steps)
        # the physical limit: the busiest rank's forward and backward work, one microbatch after
        # another with no bubble, measured with each rank alone and with all at once
        # (stage_limit.py), in every round; each share is the median of the rounds' own
        # each side's share of each limit: "atoll_share_of_limit", "torch_share_of_contended_limit", ...
        for i, (key, share) in enumerate({"physical_limit": "limit", "contended_limit": "contended_limit"}.items()):
            per_round = [costs[i] for costs in limits]
            row[f"{key}_ms_per_microbatch_per_rank"] = [round(median(list(c)) * 1e3, 2) for c in zip(*per_round)]
            rates = [1 / (max(costs) * args.microbatches) for costs in per_round]
            row[f"{key}_steps_per_s"] = round(median(rates), 3)
            row[f"{key}_steps_per_s_per_round"] = [round(r, 3) for r in rates]
            for side in [*ATOLL_SIDES, "peer"]:
                label = "torch" if side == "peer" else side
                row[f"{label}_share_of_{share}"] = round(median([m[side] / r for m, r in zip(rounds, rates)]), 3)
    if args.device == "cuda":
        row["cuda_max_allocated_per_rank"] = [memory[r]["cuda_max_allocated"] for r in range(args.ranks)]
    return row


def compute_per_rank(trace, microbatches: int) -> list[tuple[float, float]]:
    """Per pipeline rank, from a job's timelines: (seconds of compute per microbatch, seconds of
    the optimizer's step per step), each the median over the steps. A compute span holds the
    waits for the receives it takes; those are left out."""
    rank_of = {w["worker"]: w["rank"] for w in trace.summary["workers"]}
    per: dict[tuple[int, int], list[float]] = {}  # (rank, step) -> [compute, optimizer] seconds
    for e in trace.measured_spans():
        sums = per.setdefault((rank_of[e["tid"]], e["args"]["step"]), [0.0, 0.0])
        if e["cat"] == "compute":
            sums[0] += e["dur"] / 1e6
        elif e["cat"] == WAIT and e["name"] != f"{WAIT} sends":  # a receive's wait, inside a compute
            sums[0] -= e["dur"] / 1e6
        elif e["cat"] == "step":
            sums[1] += e["dur"] / 1e6
    ranks = sorted({r for r, _ in per})
    return [
        (
            median([c / microbatches for (r, _), (c, _) in per.items() if r == rank]),
            median([o for (r, _), (_, o) in per.items() if r == rank]),
        )
        for rank in ranks
    ]


def rotated(names: list[str], turn: int) -> list[str]:
    """``names`` from the ``turn``-th on, then the rest: run in this order in round ``turn``, each
    side takes every place in the round in turn, so that what one run leaves the next (on the GPT
    example the ``auto`` job, then always first in its round, read 1.14x the rate of its identical
    copy, always last) falls on all alike."""
    k = turn % len(names)
    return names[k:] + names[:k]


def significant(seconds: float) -> float:
    """A time to four significant figures: rounding to fixed decimals would leave a short step
    (the smallest sizes' tens of microseconds) one or two digits, or zero, and the ratios printed
    beside it would not follow from the figures printed."""
    return float(f"{seconds:.4g}")


def auto_row(client, model, batches, args, rows: list[dict]) -> dict:
    """atoll's schedule="auto" (one chunk per worker, and the layouts ``--auto-*`` allow): what it
    chose, its predicted step time against the measured one, and every candidate measured beside
    it: all loaded at once and run in turn, a round of each per round (in an order rotating round
    by round, ``rotated``), so that the machine's drift (tens of percent over minutes on a busy
    2-core machine) falls on all alike; the rows above were measured minutes
    apart and are listed as they were. Each candidate runs its rounds two ways: one step at a
    time, each waited for, as the calibration ran them, against the prediction of a step on its
    own (its simulated makespan plus the overhead the calibration measured: like against like),
    and several steps to a call (``--steps-per-call``, two calls in flight, as training runs them;
    at least two calls a round; the keys ending ``_back_to_back``) against the prediction the
    choice is made on (the simulated step after another, plus what the calibration measured a
    step back to back to cost beyond it): each round's rate from the first call's end to the last
    call's (``AtollSide.steady_rate``), as the calibration measures, since a long run pays its
    first call's way in once (the rows' several-to-a-call rates, listed beside, pay it once a
    round). The chosen schedule's measured step is the median of both its copies' rounds (the
    auto job's own beside it). With ``--auto-microbatches`` or ``--auto-virtual-stages`` the job
    may also run in those layouts: every candidate the calibration measured runs beside it, named
    "SCHEDULE@MxV" (M microbatches, V chunks per worker); with other chunks per worker all of them
    cut their stages by cost, as the auto job must, so the rows (cut as torch's are) are not
    listed beside them."""
    choosing_chunks = bool(args.auto_virtual_stages)
    layouts = {"auto_microbatches": args.auto_microbatches, "auto_virtual_stages": args.auto_virtual_stages}
    atoll = AtollSide(client, model, batches, args, "auto", 1, even_split=not choosing_chunks, **layouts)
    report = atoll.job.plan.report
    choice = report["schedule_choice"]
    calibrated = calibration_configs(
        JobConfig(stages=args.ranks, microbatches=args.microbatches, schedule="auto", **layouts)
    )
    several = bool(choice["layout_steps"])  # set where more than one layout was calibrated

    def named(schedule: str, microbatches: int, chunks: int) -> str:
        return f"{schedule}@{layout_name(microbatches, chunks)}" if several else schedule

    layout = (report["microbatches"], report["virtual_stages"])  # the one it chose
    chosen = named(choice["chosen"], *layout)
    predicted = {named(c["schedule"], *layout): c["predicted_step_s"] for c in choice["candidates"]}
    lone = {named(c["schedule"], *layout): c["predicted_lone_step_s"] for c in choice["candidates"]}
    sides = {"auto": atoll}
    try:
        for c in calibrated:  # every candidate in every layout, as the calibration measured them
            sides[named(c.schedule, c.microbatches, c.virtual_stages)] = AtollSide(
                client, model, batches, args, c.schedule, c.virtual_stages, c.microbatches, not choosing_chunks
            )
        together: dict[str, list[float]] = {name: [] for name in sides}
        waited: dict[str, list[float]] = {name: [] for name in sides}
        for turn in range(args.rounds):
            for name in rotated(list(sides), turn):
                together[name].append(sides[name].steady_round()[1])
                waited[name].append(sides[name].run(args.steps)[0])
    finally:
        for side in sides.values():
            side.close()
    row = {"chosen": chosen, "why": choice["why"], "layout_steps": choice["layout_steps"]}
    for sfx, rates, prediction, in_rows in (
        ("", waited, lone, "atoll_steps_per_s"),
        ("_back_to_back", together, predicted, "atoll_per_call_steps_per_s"),
    ):
        # The chosen schedule ran twice (the auto job and its copy among the candidates): both
        # its measurements count for it, against its prediction and against each other
        # candidate, so the check compares schedules; the two copies' gap (same schedule, same
        # machine, same rounds) shows the noise both are read against.
        chosen_rate = median(rates["auto"] + rates[chosen])
        auto_rate = median(rates["auto"])
        others = [median(r) for name, r in rates.items() if name not in ("auto", chosen)]
        row |= {
            f"predicted_step_s{sfx}": significant(prediction[chosen]),
            f"measured_step_s{sfx}": significant(1 / chosen_rate),
            f"predicted_over_measured{sfx}": round(prediction[chosen] * chosen_rate, 3),
            f"predicted_over_measured_auto_job_alone{sfx}": round(prediction[chosen] * auto_rate, 3),
            f"predicted_step_s_by_candidate{sfx}": {k: significant(v) for k, v in prediction.items()},
            f"measured_steps_per_s_by_candidate_in_turn{sfx}": {
                name: round(median(r), 3) for name, r in rates.items() if name != "auto"
            },
            f"measured_steps_per_s_by_candidate_in_rows{sfx}": {
                name: r[in_rows]
                for r in rows
                if not choosing_chunks
                and (name := named(r["schedule"], args.microbatches, r["virtual_stages"])) in sides
            },
            # the chosen schedule's rate over the fastest measured (1.0: none measured faster)
            f"chosen_vs_fastest_measured{sfx}": round(chosen_rate / max([chosen_rate, *others]), 3),
            f"auto_job_vs_same_schedule_beside{sfx}": round(auto_rate / median(rates[chosen]), 3),
        }
    return row


def two_best(rows: list[dict], key: str, name: str) -> dict[str, dict]:
    """The rows of the two largest ``key``, by their ``name`` (distinct names: ZB-H2's row runs
    torch's ZB-H1 too)."""
    best: dict[str, dict] = {}
    for row in sorted(rows, key=lambda r: -r[key]):
        best.setdefault(row[name], row)
    return dict(list(best.items())[:2])


def head_to_head(client, model, batches, args, rows: list[dict]) -> dict:
    """Each side's best schedules from the rows, measured again in alternating rounds beside each
    other: the rows run minutes apart and this machine's speed moves 5-30% between them, so a best
    against best read across rows carries that drift; here it falls on both alike. Each side
    brings its two fastest rows (atoll's by resident rate, torch's by its rate: a share of the
    limit would not do, since the limit differs between layouts: a V's busiest rank carries the
    head) and each round counts each side's faster, so a row that was lucky in its minutes does not
    decide alone. atoll runs as in the rows' resident rounds (several steps to a call on batches the
    workers hold; also read from the first call's end, ``steady``); the order within a round
    rotates (``rotated``)."""
    ours = two_best(rows, "atoll_resident_steps_per_s", "schedule")
    theirs = two_best(rows, "torch_pipelining_steps_per_s", "torch_schedule")
    sides: dict[str, AtollSide | TorchSide] = {}
    rounds: list[dict] = []
    try:
        for name, row in ours.items():
            sides[f"atoll {name}"] = AtollSide(client, model, batches, args, name, row["virtual_stages"])
        for name, row in theirs.items():
            sides[f"torch {name}"] = TorchSide(args, name, row["virtual_stages"], row["stage_blocks"])
        for turn in range(args.rounds):
            measured = {}
            for key in rotated(list(sides), turn):
                side = sides[key]
                if isinstance(side, AtollSide):
                    measured[key], measured[f"{key} steady"] = side.steady_round(resident=True)
                else:
                    measured[key] = side.run(args.steps)[0]
            rounds.append(measured)
    finally:
        for side in sides.values():
            side.close()
    out = {
        "atoll_schedules": list(ours),
        "torch_schedules": list(theirs),
        "torch_steps_per_s_by_schedule": {n: round(median([r[f"torch {n}"] for r in rounds]), 3) for n in theirs},
    }
    for way, sfx in (("resident", ""), ("steady", " steady")):
        out[f"atoll_{way}_steps_per_s_by_schedule"] = {
            n: round(median([r[f"atoll {n}{sfx}"] for r in rounds]), 3) for n in ours
        }
        per_round = [max(r[f"atoll {n}{sfx}"] for n in ours) / max(r[f"torch {n}"] for n in theirs) for r in rounds]
        out[f"ratio_atoll_{way}_over_torch_per_round"] = [round(x, 3) for x in per_round]
        out[f"ratio_atoll_{way}_over_torch"] = round(median(per_round), 3)
    return out


def best_by(rows: list[dict], torch_key: str, atoll_key: str, label: str) -> dict:
    """Each side's best schedule by a row's figure (``torch_key``; ``atoll_key`` with each of
    atoll's ways for ``{side}``), under ``label``, and the ratio of atoll's to torch's."""
    theirs = max(rows, key=lambda r: r[torch_key])
    best = {"torch": {"schedule": theirs["torch_schedule"], label: theirs[torch_key]}}
    for side in ATOLL_SIDES:  # each of atoll's ways at its own best schedule
        key = atoll_key.format(side=side)
        ours = max(rows, key=lambda r: r[key])
        best[side] = {"schedule": ours["schedule"], label: ours[key]}
        best[f"ratio_{side}_over_torch"] = round(ours[key] / theirs[torch_key], 3)
    return best


def comma_separated_ints(text: str) -> list[int]:
    return [int(c) for c in text.split(",") if c]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b,zb_h1,zb_h2,zbv,dualpipev,auto")
    parser.add_argument("--model", choices=["gpt", "mlp"], default="gpt", help="mlp: 8 x Linear(1024, 1024) + GELU")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--virtual-stages", type=int, default=2, help="for interleaved_1f1b")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument(
        "--auto-microbatches",
        type=comma_separated_ints,
        default=[],
        help='other microbatch counts schedule="auto" may choose (comma-separated); its candidates run at each',
    )
    parser.add_argument(
        "--auto-virtual-stages",
        type=comma_separated_ints,
        default=[],
        help='other chunks per worker schedule="auto" may choose (comma-separated; its stages then cut by cost)',
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="alternating atoll/torch rounds per schedule")
    parser.add_argument("--steps", type=int, default=8, help="steps per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--steps-per-call",
        type=int,
        default=4,
        help="atoll's third measurement: job.steps_async with this many steps to a call, two calls in flight",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--limit-window-s", type=float, default=WINDOW_S, help="CPU: seconds per limit measurement, one a round"
    )
    parser.add_argument(
        "--mps",
        choices=["auto", "on", "off"],
        default="auto",
        help="with --device cuda: the workers share the GPU through CUDA MPS (auto: LocalCluster's default)",
    )
    args = parser.parse_args()
    if args.mps == "on" and args.device != "cuda":
        parser.error("--mps on needs --device cuda")
    args.threads = max(1, (os.cpu_count() or 1) // args.ranks)
    if args.device == "cuda" and args.threads > 4:
        args.threads = 4  # the GPU does the work; more host threads per worker only contend

    model, batches = make_setup(args)
    rows = []
    devices = ["cuda:0"] * args.ranks if args.device == "cuda" else None
    with (
        atoll.LocalCluster(
            workers=args.ranks,
            threads_per_worker=args.threads,
            devices=devices,
            cuda_mps={"auto": None, "on": True, "off": False}[args.mps],
        ) as cluster,
        cluster.client() as client,
    ):
        mps_running = cluster.mps_running
        schedules = args.schedules.split(",")
        if "dualpipev" in schedules and args.microbatches < 2 * args.ranks:  # as torch, atoll refuses it
            print(f"dualpipev left out: it needs {2 * args.ranks} microbatches or more", file=sys.stderr)
            schedules.remove("dualpipev")
        for schedule in (s for s in schedules if s != "auto"):
            rows.append(compare(client, model, batches, args, schedule, process_pids(cluster)))
        auto = auto_row(client, model, batches, args, rows) if "auto" in schedules and args.device == "cpu" else None
        head = head_to_head(client, model, batches, args, rows) if args.device == "cpu" and rows else None
    best = {}
    if args.device == "cpu" and rows:  # each side's fastest schedule, as a user would pick it
        best = best_by(rows, "torch_pipelining_steps_per_s", "{side}_steps_per_s", "steps_per_s")
        # and by its share of the limit measured in the same rounds as its rate: the rows run
        # minutes apart and the machine drifts between them (the limit moved 8.5 to 9.5 steps/s
        # over the rows of one 2-stage run); the shares cancel the drift. Shares of one limit
        # only: the schedules with a stage per rank share their stages, while a V's or an
        # interleaved layout's limit differs (at 4 stages of the MLP job a V's busiest rank
        # carries the head: its limit 12.7 to 13.5 steps/s against 16 to 17)
        one_stage_per_rank = [r for r in rows if r["virtual_stages"] == 1]
        if one_stage_per_rank:
            best["by_share_of_limit"] = best_by(
                one_stage_per_rank, "torch_share_of_limit", "{side}_share_of_limit", "share"
            )
        # what a schedule running at the contended limit (every rank's forward and backward at
        # once, no pipeline, no communication) would show against torch's best, read in torch's
        # best row's rounds. With a core per rank that is about the most any schedule of this
        # arithmetic gets here; with more ranks than cores it is not (a pipeline's ranks do not
        # all run at once: ZB-H2 at 4 stages on 2 cores ran at 1.10-1.13 of it)
        theirs = max(rows, key=lambda r: r["torch_pipelining_steps_per_s"])
        best["contended_limit_over_torch"] = round(1 / theirs["torch_share_of_contended_limit"], 3)
        best["head_to_head"] = head
    if args.model == "mlp":
        described = f"mlp {MLP_BLOCKS} x Linear({MLP_WIDTH}, {MLP_WIDTH}) + GELU, head to {MLP_OUT}"
    else:
        described = f"gpt layers={args.layers} d_model={args.d_model}"
    print(
        json.dumps(
            {
                "benchmark": "pipeline",
                "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                "peer": "one process on the same GPU" if args.device == "cuda" else "torch.distributed.pipelining",
                "cuda_mps": mps_running,
                "dtype": args.dtype,
                "block_size": args.block_size,
                "ranks": args.ranks,
                "microbatches": args.microbatches,
                "batch": args.batch,
                "model": f"{described} params={sum(p.numel() for p in model.parameters())}",
                "rounds": args.rounds,
                "steps_per_round": args.steps,
                "steps_per_call": args.steps_per_call,
                "warmup_steps": args.warmup,
                "threads_per_process": args.threads,
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "python": platform.python_version(),
                "rows": rows,
                "best": best,
                "auto": auto,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
