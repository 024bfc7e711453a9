"""Stage-to-stage transfer bandwidth on one GPU: atoll's cuda_ipc path next to a raw copy.

Prints one JSON object. For each size: a device-to-device copy inside one process (the ceiling),
atoll's CudaIpcTransport between two worker-like processes (the receiver keeps ``--depth``
receives posted ahead, as a pipeline's receive slots do), and atoll's gloo transport through
pinned host memory between the same two processes. Bandwidth counts each payload byte once.

    python bench/transport.py [--sizes-mb 1 64] [--iters 200]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

TIMEOUT_S = 60.0


def raw_copy_gbps(nbytes: int, iters: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(10):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return nbytes * iters / (start.elapsed_time(end) / 1e3) / 1e9


def _make_transport(kind: str, store, rank: int, buffers_region: torch.Tensor, buffers: list[torch.Tensor]):
    from atoll.worker.transports.cuda_ipc import CudaIpcTransport
    from atoll.worker.transports.gloo import GlooTransport

    if kind == "cuda_ipc":
        return CudaIpcTransport(
            store=store, rank=rank, peers=[1 - rank], region=buffers_region, buffers=buffers, timeout_s=TIMEOUT_S
        )
    return GlooTransport(store=store, rank=rank, world_size=2, hostname="127.0.0.1", timeout_s=TIMEOUT_S)


def _peer(kind: str, rank: int, port: int, prefix: str, nbytes: int, iters: int, depth: int, out) -> None:
    torch.cuda.set_device(0)
    store = dist.PrefixStore(
        prefix, dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    )
    region = torch.empty(depth * nbytes, dtype=torch.uint8, device="cuda")
    buffers = [region[i * nbytes : (i + 1) * nbytes] for i in range(depth)] if rank == 1 else []
    transport = _make_transport(kind, store, rank, region, buffers)
    src = (torch.arange(nbytes, device="cuda") % 251).to(torch.uint8)  # the same bytes in both processes
    rounds = [(10, False), (iters, True)]  # warm-up, then timed
    tag = 0
    for count, timed in rounds:
        store.set(f"go/{rank}/{timed}", "1")
        store.wait([f"go/{1 - rank}/{timed}"])
        torch.cuda.synchronize()
        started = time.perf_counter()
        if rank == 0:
            handles = [transport.send(src, 1, tag + i) for i in range(count)]
            for h in handles:
                h.wait(TIMEOUT_S)
        else:
            posted = [transport.recv(buffers[i % depth], 0, tag + i) for i in range(min(depth, count))]
            for i in range(count):
                posted[i].wait(TIMEOUT_S)
                if i + depth < count:
                    posted.append(transport.recv(buffers[(i + depth) % depth], 0, tag + i + depth))
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        tag += count
        if timed and rank == 1:
            ok = bool(torch.equal(buffers[(count - 1) % depth], src))
            out.put({"gbps": nbytes * count / elapsed / 1e9, "elapsed_s": elapsed, "checked": ok})
    torch.cuda.synchronize()
    transport.close()  # before the barrier: neither process exits while the other maps its memory
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{1 - rank}"])


def between_processes_gbps(kind: str, nbytes: int, iters: int, depth: int) -> dict:
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    out = ctx.Queue()
    prefix = f"{kind}/{nbytes}/"
    procs = [ctx.Process(target=_peer, args=(kind, r, store.port, prefix, nbytes, iters, depth, out)) for r in (0, 1)]
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
        raise RuntimeError(f"{kind} peers exited with {[p.exitcode for p in procs]}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 64])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--gloo-iters", type=int, default=20)
    parser.add_argument(
        "--depths", type=int, nargs="+", default=[2, 8], help="receives posted ahead (receive slots), one row each"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/transport.py needs a CUDA device")
    rows = []
    for mb in args.sizes_mb:
        nbytes = int(mb * 2**20)
        raw = raw_copy_gbps(nbytes, args.iters)
        gloo = between_processes_gbps("gloo", nbytes, args.gloo_iters, 2)
        for depth in args.depths:
            ipc = between_processes_gbps("cuda_ipc", nbytes, args.iters, depth)
            row = {
                "megabytes": mb,
                "receives_posted_ahead": depth,
                "raw_device_copy_GBps": round(raw, 1),
                "atoll_cuda_ipc_GBps": round(ipc["gbps"], 1),
                "ratio_cuda_ipc_to_raw": round(ipc["gbps"] / raw, 3),
                "atoll_gloo_pinned_host_GBps": round(gloo["gbps"], 2),
                "ratio_cuda_ipc_to_gloo": round(ipc["gbps"] / gloo["gbps"], 1),
                "payloads_equal_source": bool(ipc["checked"] and gloo["checked"]),
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)  # what a run cut short still shows
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


if __name__ == "__main__":
    main()
