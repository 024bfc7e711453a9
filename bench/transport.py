"""Stage-to-stage transfer bandwidth on one GPU: atoll's cuda_ipc path next to a raw copy.
Without CUDA (or with ``--device cpu``): what CPU workers move, and the smoke test CI runs: atoll's
socket transport (the default between CPU workers) and its gloo transport between two CPU
processes, next to a copy inside one, and each one's round trip of a 64-byte message.

Prints one JSON object. For each size: a device-to-device copy inside one process (the ceiling),
atoll's CudaIpcTransport between two worker-like processes (the receiver keeps ``--depth``
receives posted ahead, as a pipeline's receive slots do), and atoll's gloo transport through
pinned host memory between the same two processes. Bandwidth counts each payload byte once. Each
row also gives both processes' CPU time per timed transfer by thread (``cpu_us_per_transfer``): a
thread near the transfer's period bounds the rate.

    python bench/transport.py [--sizes-mb 1 64] [--iters 200] [--mps] [--orderings flags events]

Each cuda_ipc row names its ordering (atoll.worker.transports.cuda_marks: GPU-side counters, or
interprocess events). After the timed transfers each pair checks the ordering itself: 4 x depth
transfers of different bytes, each compared on arrival with what was sent.

``--mps`` measures the cuda_ipc rows a second time with the two processes sharing the GPU through a
private CUDA MPS daemon (atoll.client.cuda_mps), as ``LocalCluster(cuda_mps=True)`` runs workers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from peers import peer_context  # noqa: E402

TIMEOUT_S = 60.0


def raw_copy_gbps(nbytes: int, iters: int, device: str = "cuda") -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(10):
        dst.copy_(src)
    if device == "cpu":
        started = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        return nbytes * iters / (time.perf_counter() - started) / 1e9
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return nbytes * iters / (start.elapsed_time(end) / 1e3) / 1e9


def _make_transport(kind: str, store, rank: int, region: torch.Tensor, buffers: list[torch.Tensor], ordering):
    from atoll.worker.transports.cuda_ipc import CudaIpcTransport
    from atoll.worker.transports.gloo import GlooTransport
    from atoll.worker.transports.sockets import SocketTransport

    if kind == "socket":
        return SocketTransport(store=store, rank=rank, peers=[1 - rank], host="127.0.0.1", timeout_s=TIMEOUT_S)
    if kind == "cuda_ipc":
        peers = [1 - rank]
        return CudaIpcTransport(
            store=store, rank=rank, peers=peers, region=region, buffers=buffers, timeout_s=TIMEOUT_S, ordering=ordering
        )
    return GlooTransport(store=store, rank=rank, world_size=2, hostname="127.0.0.1", timeout_s=TIMEOUT_S)


def _payload(nbytes: int, n: int, device: str) -> torch.Tensor:
    """Transfer n's bytes, the same in both processes and different from transfer n-1's."""
    return ((torch.arange(nbytes, device=device) + n) % 251).to(torch.uint8)


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds each of this process's Python threads has used so far, by name, and the rest of
    the process's (threads Python did not start, CUDA's and gloo's, and threads that ended) as
    "other": which thread a transfer's host work lands on, and so which one bounds the rate."""
    used = {}
    for t in threading.enumerate():
        try:
            used[t.name] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, TypeError):
            continue  # the thread ended meanwhile
    used["other"] = max(0.0, time.process_time() - sum(used.values()))
    return used


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _transfers(transport, rank: int, buffers: list[torch.Tensor], first_tag: int, sources, on_arrival=None) -> None:
    """Rank 0 sends ``sources`` in order; rank 1 keeps ``len(buffers)`` receives posted ahead."""
    count, depth = len(sources), len(buffers)
    if rank == 0:
        for h in [transport.send(src, 1, first_tag + i) for i, src in enumerate(sources)]:
            h.wait(TIMEOUT_S)
        return
    posted = [transport.recv(buffers[i % depth], 0, first_tag + i) for i in range(min(depth, count))]
    for i in range(count):
        posted[i].wait(TIMEOUT_S)
        if on_arrival is not None:
            on_arrival(i, buffers[i % depth])
        if i + depth < count:
            posted.append(transport.recv(buffers[(i + depth) % depth], 0, first_tag + i + depth))


def _peer(kind: str, ordering, device: str, nbytes: int, iters: int, depth: int, rank: int, port: int, out) -> None:
    from atoll.worker.transports.cuda_marks import under_mps

    if device == "cuda":
        torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    region = torch.empty(depth * nbytes, dtype=torch.uint8, device=device)
    buffers = [region[i * nbytes : (i + 1) * nbytes] for i in range(depth)]
    transport = _make_transport(kind, store, rank, region, buffers if rank == 1 else [], ordering)
    src = _payload(nbytes, 0, device)
    tag, result = 0, {"ordering": getattr(transport, "ordering", None), "under_mps": under_mps()}
    for count, timed in [(10, False), (iters, True)]:  # warm-up, then timed
        store.set(f"go/{rank}/{timed}", "1")
        store.wait([f"go/{1 - rank}/{timed}"])
        _sync(device)
        started, cpu = time.perf_counter(), thread_cpu_s()
        _transfers(transport, rank, buffers, tag, [src] * count)
        _sync(device)
        elapsed = time.perf_counter() - started
        tag += count
        if timed:
            result.update(gbps=nbytes * count / elapsed / 1e9, elapsed_s=elapsed)
            cpu = {name: (s - cpu.get(name, 0.0)) / count * 1e6 for name, s in thread_cpu_s().items()}
            store.set(f"cpu/{rank}", json.dumps({name: round(us, 1) for name, us in cpu.items() if us > 0}))
    # then check the ordering: every transfer carries different bytes, and each must arrive whole
    # before the receiver's stream reads it and not be overwritten before that read
    checks = 4 * depth
    wrong = []
    sources = [_payload(nbytes, n, device) for n in range(1, checks + 1)]
    _sync(device)

    def check(i: int, buffer: torch.Tensor) -> None:
        if not torch.equal(buffer, sources[i]):
            wrong.append(i)

    _transfers(transport, rank, buffers, tag, sources, check)
    _sync(device)
    if rank == 1:
        cpu = {"sender": json.loads(store.get("cpu/0")), "receiver": json.loads(store.get("cpu/1"))}
        out.put({**result, "checked": not wrong, "wrong_transfers": wrong, "cpu_us_per_transfer": cpu})
    store.set(f"checked/{rank}", "1")  # the sender stays connected until every arrival was compared
    store.wait([f"checked/{1 - rank}"])
    transport.close()  # before the barrier: neither process exits while the other maps its memory
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{1 - rank}"])


def _ping_pong(kind: str, iters: int, rank: int, port: int, out) -> None:
    """Rank 0 sends 64 bytes, rank 1 sends them back, ``iters`` times: the round trip's seconds
    and each side's CPU seconds per round trip."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    transport = _make_transport(kind, store, rank, torch.empty(0), [], None)
    buf, peer = torch.zeros(16), 1 - rank
    for count, timed in [(50, False), (iters, True)]:
        store.set(f"go/{rank}/{timed}", "1")
        store.wait([f"go/{peer}/{timed}"])
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(count):
            if rank == 0:
                back = transport.recv(buf, peer, 2 * i + 1)
                transport.send(buf, peer, 2 * i).wait(TIMEOUT_S)
                back.wait(TIMEOUT_S)
            else:
                transport.recv(buf, peer, 2 * i).wait(TIMEOUT_S)
                transport.send(buf, peer, 2 * i + 1).wait(TIMEOUT_S)
        wall, cpu = (time.perf_counter() - wall) / count, (time.process_time() - cpu) / count
    store.set(f"cpu/{rank}", str(cpu))
    if rank == 1:
        out.put({"round_trip_us": wall * 1e6, "cpu_us_per_round_trip": [float(store.get("cpu/0")) * 1e6, cpu * 1e6]})
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{peer}"])
    transport.close()


def between_processes_gbps(
    kind: str, nbytes: int, iters: int, depth: int, ordering: str | None = None, device: str = "cuda", ctx=None
) -> dict:
    return run_pair(_peer, kind, ordering, device, nbytes, iters, depth, ctx=ctx)


def run_pair(target, *args, ctx=None) -> dict:
    """``target(*args, rank, store_port, out)`` in two processes (ranks 0 and 1) that meet at a
    TCPStore of their own; returns what rank 1 puts on ``out``. Spawned unless ``ctx`` says
    otherwise: the CUDA rows' peers must see the CUDA MPS variables set after this process began."""
    ctx = ctx or mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, rank, store.port, out)) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=300)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join(10)
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"{target.__name__}{args}: peers exited with {[p.exitcode for p in procs]}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 64])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--gloo-iters", type=int, default=20)
    parser.add_argument("--round-trips", type=int, default=2000, help="CPU: 64-byte round trips per transport")
    parser.add_argument(
        "--depths", type=int, nargs="+", default=[2, 8], help="receives posted ahead (receive slots), one row each"
    )
    parser.add_argument("--mps", action="store_true", help="also measure cuda_ipc with the peers under CUDA MPS")
    parser.add_argument(
        "--orderings", nargs="+", default=["flags", "events"], help="cuda_ipc orderings to measure, one row each"
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.device == "cpu":
        return _cpu_rows(args)
    if not torch.cuda.is_available():
        raise SystemExit("bench/transport.py --device cuda needs a CUDA device")
    rows = []
    sizes = [(mb, int(mb * 2**20)) for mb in args.sizes_mb]
    raw = {mb: raw_copy_gbps(nbytes, args.iters) for mb, nbytes in sizes}
    gloo = {mb: between_processes_gbps("gloo", nbytes, args.gloo_iters, 2) for mb, nbytes in sizes}
    for mps in [False, True] if args.mps else [False]:
        if mps:
            from atoll.client.cuda_mps import CudaMps

            daemon = CudaMps(Path(tempfile.mkdtemp(prefix="atoll-mps-")))
            os.environ.update(daemon.env)  # the spawned peers connect to it when they first touch the GPU
        try:
            for mb, nbytes in sizes:
                for ordering in args.orderings:
                    rows += [
                        _row(mb, nbytes, depth, raw[mb], gloo[mb], mps, args.iters, ordering) for depth in args.depths
                    ]
        finally:
            if mps:
                daemon.stop()
                for name in daemon.env:
                    os.environ.pop(name)
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(0),
                "torch": torch.__version__,
                "iters": args.iters,
                "gloo_iters": args.gloo_iters,
                "results": rows,
            },
            indent=2,
        )
    )


def _cpu_rows(args) -> None:
    """CPU workers' data plane: the socket and gloo transports between two processes, next to a
    copy inside one; then each one's round trip of a small message. The peers fork from one server
    (bench/peers.py), under the malloc settings of atoll's daemons."""
    ctx = peer_context()
    rows = []
    for mb in args.sizes_mb:
        nbytes = int(mb * 2**20)
        raw = raw_copy_gbps(nbytes, args.iters, "cpu")
        row = {"megabytes": mb, "raw_copy_GBps": round(raw, 2)}
        for kind in ("socket", "gloo"):
            got = between_processes_gbps(kind, nbytes, args.gloo_iters, 2, device="cpu", ctx=ctx)
            row[f"atoll_{kind}_GBps"] = round(got["gbps"], 3)
            row[f"ratio_{kind}_to_raw"] = round(got["gbps"] / raw, 4)
            row[f"{kind}_payloads_arrive_whole_and_in_order"] = got["checked"]
            row[f"{kind}_wrong_transfers"] = got["wrong_transfers"]
            row[f"{kind}_cpu_us_per_transfer"] = got["cpu_us_per_transfer"]
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    trips = {kind: run_pair(_ping_pong, kind, args.round_trips, ctx=ctx) for kind in ("socket", "gloo")}
    small = {
        **{f"{kind}_{k}": [round(v, 1) for v in x] if isinstance(x, list) else round(x, 1)
           for kind, trip in trips.items() for k, x in trip.items()},
        "ratio_gloo_to_socket_round_trip": round(trips["gloo"]["round_trip_us"] / trips["socket"]["round_trip_us"], 2),
    }  # fmt: skip
    report = {"device": "cpu", "cpus": os.cpu_count(), "torch": torch.__version__, "gloo_iters": args.gloo_iters}
    print(json.dumps({**report, "results": rows, "round_trip_64_bytes": small}, indent=2))


def _row(mb: float, nbytes: int, depth: int, raw: float, gloo: dict, mps: bool, iters: int, ordering: str) -> dict:
    ipc = between_processes_gbps("cuda_ipc", nbytes, iters, depth, ordering)
    row = {
        "megabytes": mb,
        "receives_posted_ahead": depth,
        "cuda_mps": mps,
        "ordering": ipc["ordering"],
        "peers_see_mps": ipc["under_mps"],
        "raw_device_copy_GBps": round(raw, 1),
        "atoll_cuda_ipc_GBps": round(ipc["gbps"], 1),
        "ratio_cuda_ipc_to_raw": round(ipc["gbps"] / raw, 3),
        "atoll_gloo_pinned_host_GBps": round(gloo["gbps"], 2),
        "ratio_cuda_ipc_to_gloo": round(ipc["gbps"] / gloo["gbps"], 1),
        "payloads_arrive_whole_and_in_order": bool(ipc["checked"] and gloo["checked"]),
        "wrong_transfers": ipc["wrong_transfers"],
        "cpu_us_per_transfer": ipc["cpu_us_per_transfer"],
    }
    print(json.dumps(row), file=sys.stderr, flush=True)  # what a run cut short still shows
    return row


if __name__ == "__main__":
    main()
