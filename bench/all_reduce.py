"""Benchmark: the data-parallel replicas' gradient all-reduce between CPU processes, atoll's ring
over sockets (the default between CPU replicas, runtime/worker/transports/socket_ring.py) next to
its gloo group (``transport="gloo"``, and every ZeRO job), in one run. Prints one JSON object.

    python bench/all_reduce.py [--ranks 8] [--mb 1.2] [--iters 60]
    python bench/all_reduce.py --ranks 2 --mb 0.01 --iters 3   # smallest (smoke test)

Each rank is a process of its own (one intra-op thread, as a worker on this machine), holding
the same buckets a replica would: ``--mb`` of float32 gradients in 8 tensors. For each transport:
the CPU time (user + system, every thread of the process) and the wall time per all-reduce, each
rank's mean, and a check that every rank ends with the sum. With more processes than cores, the
CPU is what a step pays. Nothing here asserts on time.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from peers import peer_context  # noqa: E402

from atoll.worker.transports.gloo import GlooTransport  # noqa: E402
from atoll.worker.transports.socket_ring import SocketRing  # noqa: E402

TIMEOUT_S = 60.0
TENSORS = 8


def _rank(kind: str, rank: int, ranks: int, port: int, numel: int, iters: int, out) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, ranks + 1, False, timeout=datetime.timedelta(seconds=60))
    store = dist.PrefixStore(kind, store)
    if kind == "socket":
        group = SocketRing(store=store, rank=rank, world_size=ranks, host="127.0.0.1", timeout_s=TIMEOUT_S)
    else:
        group = GlooTransport(store=store, rank=rank, world_size=ranks, hostname="127.0.0.1", timeout_s=TIMEOUT_S)
    grads = [torch.empty(n) for n in _sizes(numel)]

    def once() -> None:
        for g in grads:
            g.fill_(rank + 1.0)
        group.all_reduce_sum(grads).wait(TIMEOUT_S)

    for _ in range(3):  # warm up, and meet
        once()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(iters):
        once()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    expected = ranks * (ranks + 1) / 2
    correct = all(bool((g == expected).all()) for g in grads)
    store.add("finished", 1)  # no rank leaves the group while another still reduces
    while int(store.add("finished", 0)) < ranks:
        time.sleep(0.01)
    group.close()
    out.put((rank, cpu / iters, wall / iters, correct))


def _sizes(numel: int) -> list[int]:
    each = max(1, numel // TENSORS)
    return [each] * (TENSORS - 1) + [max(1, numel - each * (TENSORS - 1))]


def measure(kind: str, ranks: int, numel: int, iters: int) -> dict:
    ctx = peer_context()  # forked from one server that imported torch and atoll (bench/peers.py)
    master = dist.TCPStore(
        "127.0.0.1", 0, ranks + 1, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
    )
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(kind, r, ranks, master.port, numel, iters, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return {
        "cpu_ms_per_rank": round(sum(r[1] for r in results) / ranks * 1e3, 3),
        "wall_ms": round(sum(r[2] for r in results) / ranks * 1e3, 3),
        "sums_correct": all(r[3] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--mb", type=float, default=1.2, help="gradient megabytes per rank (float32)")
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2, help="alternating socket/gloo measurements")
    args = parser.parse_args()
    numel = max(TENSORS, int(args.mb * 1e6 / 4))
    rows = {"socket": [], "gloo": []}
    for _ in range(args.rounds):
        for kind in rows:
            rows[kind].append(measure(kind, args.ranks, numel, args.iters))
    best = {k: min(v, key=lambda r: r["cpu_ms_per_rank"]) for k, v in rows.items()}
    cpu_ratio = best["socket"]["cpu_ms_per_rank"] / best["gloo"]["cpu_ms_per_rank"]
    print(
        json.dumps(
            {
                "benchmark": "all_reduce",
                "ranks": args.ranks,
                "bytes_per_rank": numel * 4,
                "tensors": TENSORS,
                "iters": args.iters,
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "rounds": rows,
                "ratio_socket_over_gloo_cpu": round(cpu_ratio, 3),
                "ratio_socket_over_gloo_wall": round(best["socket"]["wall_ms"] / best["gloo"]["wall_ms"], 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
