"""Benchmark: what dispatch costs, measured in one run. Prints one JSON object.

    python bench/dispatch.py [--iters 200] [--steps 200]

(a) round trip: the median time of one tiny forward-only step (``job.forward``) through a 4-stage
    chain on a local cluster, next to a raw torch.distributed gloo chain with the same topology
    (a driver process sends to rank 0, each rank passes the tensor on, the last sends it back to
    the driver: 4 processes plus a driver), and their ratio; then the median synchronous
    training step (``job.step``) on the same chain;
(b) tiny training steps per second with 1 and with 16 steps in flight (``job.max_in_flight``),
    and sent 4 and 16 to a call (``job.steps_async``, 2 calls in flight): each the median of
    ``--rate-rounds`` rounds that take the four in turn (every round's rates are reported too);
    the CPU time per step (16 in flight) of every process: the client, the controller and each
    worker (the four without a stage show what idling beside costs), and the CPU per step by
    process at 16 to a call; beside them the floor (bench/tiny_floor.py): the same training steps
    in 4 plain PyTorch processes joined by socket pairs, with no runtime, and the share of that
    floor atoll's best rate reached;
(c) tiny training steps per second through the 4-stage chain with parallel dispatch (a step goes
    to all ranks at once) and with ``dispatch="sequential"`` (each rank only once the previous
    has started the step), 16 steps in flight, and their ratio;
(d) the controller's CPU time per tiny training step as the chain grows over 1, 2, 4 and 8 real
    workers (user + system time of the controller process, from /proc), and over 64 to 1,024
    simulated workers (bench/sim_workers.py: processes that register many workers each and
    answer control calls without running stages), with the step sent directly to every worker
    and relayed through a tree of the workers (what "parallel" dispatch does above 16 workers). The
    simulated cluster's controller asks for heartbeats every 10 minutes, so that dispatch is what
    is measured; the CPU it spends while idle is measured just before each run, subtracted, and
    reported;
(e) with ray importable (the ``bench`` extra), the same 4-stage chain on Ray Compiled Graphs
    (bench/ray_chain.py), run after atoll's cluster stopped: its forward round trip and training
    step next to atoll's synchronous ones from (a) and from a second round on a fresh cluster
    after Ray's (the ratios are over the mean of the two), and whether both trained to the same
    first losses.

Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_floor import no_runtime_floor  # noqa: E402

import atoll  # noqa: E402
from atoll.client.local import stop_processes  # noqa: E402

try:  # the peer (the `bench` extra)
    import ray_chain  # noqa: E402
except ImportError:
    ray_chain = None

WIDTH = 8


def tiny(stages: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(stages)]), torch.randn(2, WIDTH)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank: int, world: int, port: int, iters: int, results) -> None:
    """Ranks 0..world-2 pass the tensor on; rank world-1 is the driver and times round trips."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    driver, last = world - 1, world - 2
    t = torch.randn(2, WIDTH)
    times = []
    for _ in range(iters):
        if rank == driver:
            start = time.perf_counter()
            dist.send(t, 0)
            dist.recv(t, last)
            times.append(time.perf_counter() - start)
        else:
            dist.recv(t, driver if rank == 0 else rank - 1)
            t += 1.0  # a token of compute, as a stage does
            dist.send(t, driver if rank == last else rank + 1)
    if rank == driver:
        results.put(times)
    dist.destroy_process_group()


def raw_gloo_round_trip(stages: int, iters: int, timeout_s: float = 120.0) -> float:
    # forked, not spawned: this runs first, before this process has started a thread or run an op,
    # and five spawned children would each import torch again (about 6 s of CPU here)
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, stages + 1, port, iters, results)) for r in range(stages + 1)]
    for p in procs:
        p.start()
    try:
        times = results.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return statistics.median(times[iters // 10 :])  # the first ones connect and warm up


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _run_steps(job, x, steps: int, per_call: int = 1) -> int:
    """Send ``steps`` tiny training steps (``per_call`` to a ``steps_async`` call) and wait for
    them all; returns how many were sent (a multiple of ``per_call``)."""
    if per_call == 1:
        futures = [job.step_async(x, x) for _ in range(steps)]
    else:
        futures = [f for _ in range(max(1, steps // per_call)) for f in job.steps_async([(x, x)] * per_call)]
    for f in futures:
        f.result()
    return len(futures)


def _steps_per_s(job, x, steps: int, in_flight: int, per_call: int = 1) -> float:
    job.max_in_flight = in_flight
    for _ in range(10):
        job.step(x, x)
    start = time.perf_counter()
    sent = _run_steps(job, x, steps, per_call)
    return round(sent / (time.perf_counter() - start), 1)


def alternated_rates(job, x, steps: int, modes: dict[str, tuple[int, int]], rounds: int) -> dict[str, list[float]]:
    """Each mode's steps/s (``name -> (calls in flight, steps per call)``), measured in ``rounds``
    rounds that take the modes in turn, so that the machine's drift over a run (tens of percent
    over minutes on a small shared machine) falls on every mode alike; name -> the rounds' rates."""
    rates: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(rounds):
        for name, (in_flight, per_call) in modes.items():
            rates[name].append(_steps_per_s(job, x, steps, in_flight, per_call))
    return rates


def process_pids(cluster: atoll.LocalCluster) -> dict[str, int]:
    """Every process a tiny step runs in: this one (the client), the controller and each worker."""
    return {"client": os.getpid(), "controller": cluster.controller.pid} | {
        f"worker{i}": p.pid for i, p in enumerate(cluster.workers)
    }


CPU_WINDOW_S = 0.3
"""The least time a CPU-per-step measurement runs: /proc counts each process's CPU in 10 ms ticks,
and a few tiny steps (the smoke test's 3) can end before any process has been counted a tick: a
CI run read 0 in every process."""


def cpu_by_process(cluster: atoll.LocalCluster, job, x, steps: int, in_flight: int = 16, per_call: int = 1) -> dict:
    """CPU milliseconds per tiny training step in each process (client, controller, every worker
    of the cluster), ``in_flight`` calls of ``per_call`` steps in flight, over ``steps`` steps and
    at least ``CPU_WINDOW_S``; what each spent while idle over a window just before is subtracted
    (heartbeats, polling)."""
    pids = process_pids(cluster)
    job.max_in_flight = in_flight
    for _ in range(10):
        job.step(x, x)
    before = {name: _cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(IDLE_WINDOW_S / 5)
    idle_per_s = {name: (_cpu_seconds(pid) - before[name]) / (IDLE_WINDOW_S / 5) for name, pid in pids.items()}
    before, start = {name: _cpu_seconds(pid) for name, pid in pids.items()}, time.perf_counter()
    sent = 0
    while sent < steps or time.perf_counter() - start < CPU_WINDOW_S:
        sent += _run_steps(job, x, steps, per_call)
    steps, wall = sent, time.perf_counter() - start
    ms = {
        name: round(max(0.0, _cpu_seconds(pid) - before[name] - idle_per_s[name] * wall) / steps * 1e3, 3)
        for name, pid in pids.items()
    }
    return {**ms, "total": round(sum(ms.values()), 3), "steps_per_s": round(steps / wall, 1)}


SIM_PER_PROCESS = 128
IDLE_WINDOW_S = 5.0


def _start_simulated(cluster: atoll.LocalCluster, workers: int) -> list[subprocess.Popen]:
    """Processes of simulated workers on island "sim", registered once this returns."""
    procs = []
    for i in range(math.ceil(workers / SIM_PER_PROCESS)):
        count = min(SIM_PER_PROCESS, workers - i * SIM_PER_PROCESS)
        ready = cluster.log_dir / f"sim{i}.ready"
        args = ["--controller", cluster.address, "--token-file", str(cluster.log_dir / "token"), "--count", str(count)]
        args += ["--ready-file", str(ready), "--exit-with-parent", str(os.getpid())]
        script = str(Path(__file__).with_name("sim_workers.py"))
        # their banner goes to stderr: stdout carries only the report's JSON
        procs.append(subprocess.Popen([sys.executable, script, *args], stdout=sys.stderr))
    deadline = time.monotonic() + 120
    for i, proc in enumerate(procs):
        while not (cluster.log_dir / f"sim{i}.ready").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_processes(procs)
                raise RuntimeError(f"simulated workers {i} did not start (exit code {proc.returncode})")
            time.sleep(0.1)
    return procs


def _controller_cpu_ms_per_step(job, x, pid: int, steps: int, idle_window_s: float) -> dict:
    """CPU per step, less the controller's idle rate (heartbeats, health checks) measured just
    before, with the job loaded and every channel it opened still open."""
    job.max_in_flight = 16
    for _ in range(3):
        job.step(x, x)
    before = _cpu_seconds(pid)
    time.sleep(idle_window_s)
    idle_cpu_per_s = (_cpu_seconds(pid) - before) / idle_window_s
    before, start = _cpu_seconds(pid), time.perf_counter()
    futures = [job.step_async(x, x) for _ in range(steps)]
    for f in futures:
        f.result()
    wall = time.perf_counter() - start
    cpu = _cpu_seconds(pid) - before
    return {
        "cpu_ms": round((cpu - idle_cpu_per_s * wall) / steps * 1e3, 2),
        "raw_cpu_ms": round(cpu / steps * 1e3, 2),
        "steps_per_s": round(steps / wall, 1),
        "idle_cpu_ms_per_s": round(idle_cpu_per_s * 1e3, 1),
    }


def simulated_dispatch(sizes: list[int], steps: int, idle_window_s: float = IDLE_WINDOW_S) -> dict:
    report: dict = {}
    with (
        # heartbeats every 10 minutes: dispatch is measured, not heartbeat handling (whose cost
        # shows in the reported idle rate when they do come)
        atoll.LocalCluster(workers=1, heartbeat_interval_s=600.0, heartbeat_timeout_s=3600.0) as cluster,
        cluster.client() as client,
    ):
        procs = _start_simulated(cluster, max(sizes))
        try:
            pid = cluster.controller.pid
            for n in sizes:
                model, x = tiny(n)
                by_mode = {}
                for mode in ("direct", "relay"):
                    start = time.perf_counter()
                    job = client.pipeline(
                        model,
                        example_input=x,
                        example_target=x,
                        loss_fn=F.mse_loss,
                        stages=n,
                        microbatches=1,
                        islands=["sim"] * n,
                        dispatch=mode,
                    )
                    loaded = round(time.perf_counter() - start, 1)
                    cpu = _controller_cpu_ms_per_step(job, x, pid, steps, idle_window_s)
                    by_mode[mode] = {**cpu, "compile_and_load_s": loaded}
                    job.close()
                report[str(n)] = by_mode
        finally:
            stop_processes(procs)
    return report


def same_losses(ours: list[float], theirs: list[float]) -> bool:
    """The same training: as many losses, each within 1e-5 relative."""
    return len(ours) == len(theirs) and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours, theirs))


def synchronous_round(client, iters: int):
    """A fresh tiny 4-stage job's median synchronous forward (``job.forward``) and training step
    (``job.step``), ``iters`` of each, the first tenth left out; returns (the job, its batch, the
    forward's seconds, the step's seconds, the first 3 training losses)."""
    model, x = tiny(4)
    job = client.pipeline(model, example_input=x, example_target=x, loss_fn=F.mse_loss, stages=4, microbatches=1)

    def median_s(run) -> float:
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return statistics.median(times[iters // 10 :])

    forward_s = median_s(lambda: job.forward(x))
    first_losses = [job.step(x, x) for _ in range(3)]  # forward steps left the weights as they were
    return job, x, forward_s, median_s(lambda: job.step(x, x)), first_losses


def ray_side(iters: int, atoll_forward_s: float, atoll_train_s: float, atoll_losses: list[float]) -> dict | str:
    """(e) The same tiny pipeline on Ray Compiled Graphs (bench/ray_chain.py), after atoll's cluster
    has stopped, next to atoll's synchronous forward and training step: measured before Ray's and
    again on a fresh cluster after it (each ratio is over the mean of atoll's two rounds, so that
    a slower or faster spell of the machine does not fall on one side only)."""
    if ray_chain is None:
        return "ray is not importable: pip install -e '.[bench]'"
    model, x = tiny(4)
    ray = ray_chain.tiny_pipeline(model, x, iters)
    with atoll.LocalCluster(workers=4, threads_per_worker=1) as cluster, cluster.client() as client:
        job, _, forward_again_s, train_again_s, _ = synchronous_round(client, iters)
        job.close()
    forward_ms = [round(atoll_forward_s * 1e3, 3), round(forward_again_s * 1e3, 3)]
    train_ms = [round(atoll_train_s * 1e3, 3), round(train_again_s * 1e3, 3)]
    return {
        "atoll_forward_by_round": forward_ms,
        "ray_forward": ray["forward_ms"],
        "ratio_atoll_over_ray_forward": round(statistics.mean(forward_ms) / ray["forward_ms"], 2),
        "atoll_train_step_by_round": train_ms,
        "ray_train_step": ray["train_step_ms"],
        "ratio_atoll_over_ray_train_step": round(statistics.mean(train_ms) / ray["train_step_ms"], 2),
        "same_first_losses": same_losses(atoll_losses, ray["first_losses"]),
        "first_losses_atoll": atoll_losses,
        "first_losses_ray": ray["first_losses"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=200, help="round trips measured for (a)")
    parser.add_argument("--steps", type=int, default=200, help="training steps measured for (b) and (c)")
    parser.add_argument(
        "--rate-rounds", type=int, default=3, help="(b): rounds of the four rates, taken in turn; each is the median"
    )
    parser.add_argument("--chains", type=int, nargs="+", default=[1, 2, 4, 8], help="chain lengths for (d)")
    parser.add_argument("--sim-steps", type=int, default=30, help="steps measured per simulated cluster size")
    parser.add_argument("--sim-workers", type=int, nargs="*", default=[64, 256, 1024], help="simulated cluster sizes")
    args = parser.parse_args()
    report = {
        "benchmark": "dispatch",
        "device": "cpu",
        "model": f"{WIDTH}x{WIDTH} linear per stage, batch 2, 1 microbatch",
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    gloo_s = raw_gloo_round_trip(4, args.iters)
    floor = no_runtime_floor(tiny, 4, steps=max(args.steps, 100) * 5)  # forked too: before any thread starts
    workers = max(4, *args.chains)  # the 4-stage chain of (a)-(c), and the longest of (d)
    with atoll.LocalCluster(workers=workers, threads_per_worker=1) as cluster, cluster.client() as client:
        job, x, atoll_s, train_s, first_losses = synchronous_round(client, args.iters)
        report["round_trip_4_stage_ms"] = {
            "atoll_forward": round(atoll_s * 1e3, 3),
            "raw_gloo_chain": round(gloo_s * 1e3, 3),
            "ratio_atoll_over_raw": round(atoll_s / gloo_s, 2),
        }
        # steps one to a call with 1 and 16 in flight, and sent 4 and 16 to a call (2 calls in flight)
        modes = {"1": (1, 1), "16": (16, 1), "4 per call": (2, 4), "16 per call": (2, 16)}
        rates = alternated_rates(job, x, args.steps, modes, args.rate_rounds)
        median = {name: round(statistics.median(r), 1) for name, r in rates.items()}
        report["tiny_train_steps_per_s_by_steps_in_flight"] = {n: median[n] for n in ("1", "16")}
        together = {n: median[f"{n} per call"] for n in ("4", "16")}
        report["tiny_train_steps_per_s_sent_together_by_steps_per_call"] = together
        report["tiny_train_steps_per_s_per_round"] = rates
        report["cpu_ms_per_tiny_step_by_process"] = cpu_by_process(cluster, job, x, args.steps)
        report["cpu_ms_per_tiny_step_by_process_16_per_call"] = cpu_by_process(
            cluster, job, x, args.steps, in_flight=2, per_call=16
        )
        best = max(median.values())
        report["tiny_train_no_runtime_floor"] = {
            **floor,
            "same_first_losses_as_atoll": same_losses(floor["first_losses"], first_losses),
            "atoll_best_steps_per_s_over_floor": round(best / floor["steps_per_s"], 3),
        }
        job.close()
        by_dispatch = {}
        for mode in ("parallel", "sequential"):
            model, x = tiny(4)
            job = client.pipeline(
                model, example_input=x, example_target=x, loss_fn=F.mse_loss, stages=4, microbatches=1, dispatch=mode
            )
            by_dispatch[mode] = _steps_per_s(job, x, args.steps, in_flight=16)
            job.close()
        report["tiny_train_steps_per_s_by_dispatch"] = {
            **by_dispatch,
            "ratio_parallel_over_sequential": round(by_dispatch["parallel"] / by_dispatch["sequential"], 2),
        }
        controller = cluster.controller.pid
        cpu = {}
        for stages in args.chains:
            model, x = tiny(stages)
            job = client.pipeline(
                model, example_input=x, example_target=x, loss_fn=F.mse_loss, stages=stages, microbatches=1
            )
            job.max_in_flight = 16
            for _ in range(10):
                job.step(x, x)
            before = _cpu_seconds(controller)
            futures = [job.step_async(x, x) for _ in range(args.steps)]
            for f in futures:
                f.result()
            cpu[str(stages)] = round((_cpu_seconds(controller) - before) / args.steps * 1e3, 3)
            job.close()
        report["controller_cpu_ms_per_step_by_workers"] = cpu
    report["ray_compiled_graphs_4_stage_ms"] = ray_side(args.iters, atoll_s, train_s, first_losses)
    if args.sim_workers:
        report["controller_cpu_ms_per_step_by_simulated_workers"] = simulated_dispatch(args.sim_workers, args.sim_steps)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
