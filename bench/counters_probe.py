"""How fast the GPU alone can order transfers between two processes: the cuda_ipc counters
(atoll.worker.transports.cuda_marks) with no host notice in between.

Two processes on one GPU; the receiver exports its buffers and counters, the sender opens them.
Each process queues all its marks and waits up front (sender: wait *free* >= k, copy, write
*filled* = k; receiver: wait *filled* >= k, then write *free* for the buffer's next use), so the
host never waits and the rate is what the GPU's ordering allows. atoll's transport adds two host
notices per transfer (READY and FILLED) on top: bench/transport.py measures that. Under MPS this
probe's waits did not hold on an H200 (it reported more than a raw copy's rate), which is why
atoll orders by events there. Prints JSON lines; nothing here asserts.

    python bench/counters_probe.py [--sizes-mb 1 64] [--depths 2 8] [--iters 1000]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transport import TIMEOUT_S, raw_copy_gbps, run_pair  # noqa: E402


def _peer(nbytes: int, depth: int, iters: int, rank: int, port: int, out) -> None:
    from atoll.worker.transports.cuda_marks import (
        FILLED_MARK,
        FREE_MARK,
        FlagMarks,
        StreamMemoryOps,
        export_region,
        open_region,
    )

    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    src = (torch.arange(nbytes, device="cuda") % 251).to(torch.uint8)
    if rank == 1:
        region = torch.zeros(depth * nbytes, dtype=torch.uint8, device="cuda")
        counters = torch.zeros(2 * depth, dtype=torch.int32, device="cuda")
        store.set("region", json.dumps(export_region(region)))
        store.set("counters", json.dumps(export_region(counters)))
    else:
        region = open_region(json.loads(store.get("region")))
        counters = open_region(json.loads(store.get("counters"))).view(torch.int32)
    torch.cuda.synchronize()
    marks = FlagMarks(StreamMemoryOps.load(), counters, depth)
    buffers = [region[b * nbytes : (b + 1) * nbytes] for b in range(depth)]
    stream = torch.cuda.Stream() if rank == 0 else torch.cuda.current_stream()
    done = 0  # transfers so far: transfer j uses buffer j % depth for its (j // depth + 1)-th time
    for count, timed in [(20, False), (iters, True)]:
        store.set(f"go/{rank}/{timed}", "1")
        store.wait([f"go/{1 - rank}/{timed}"])
        torch.cuda.synchronize()
        started = time.perf_counter()
        for i in range(count):
            j = done + i
            buffer, use = j % depth, j // depth + 1
            if rank == 0:
                marks.await_mark(FREE_MARK, stream, buffer, use)
                buffers[buffer].copy_(src)
                marks.mark(FILLED_MARK, stream, buffer, use)
                continue
            if i == 0:  # the first depth receives are posted at once
                for ahead in range(min(depth, count)):
                    marks.mark(FREE_MARK, stream, (j + ahead) % depth, (j + ahead) // depth + 1)
            marks.await_mark(FILLED_MARK, stream, buffer, use)
            if i + depth < count:
                marks.mark(FREE_MARK, stream, buffer, use + 1)
        queued = time.perf_counter() - started
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        done += count
        if timed and rank == 1:
            whole = bool(torch.equal(buffers[(done - 1) % depth], src))
            queue_us = queued / count * 1e6
            out.put({"gbps": nbytes * count / elapsed / 1e9, "queue_us_per_transfer": queue_us, "whole": whole})
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{1 - rank}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 64])
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--iters", type=int, default=1000)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/counters_probe.py needs a CUDA device")
    for mb in args.sizes_mb:
        nbytes = int(mb * 2**20)
        raw = raw_copy_gbps(nbytes, args.iters)
        for depth in args.depths:
            row = run_pair(_peer, nbytes, depth, args.iters)
            row.update(megabytes=mb, buffers=depth, raw_gbps=round(raw, 1), ratio=round(row["gbps"] / raw, 3))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
