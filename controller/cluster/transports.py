"""Which transport carries each edge of a placed pipeline (docs/architecture.md, Transports).

The choice follows from where the two ends run and is recorded in the plan, one transport per
edge; workers build exactly the transports their plan names (runtime/worker/daemon.py).

| ends of the edge                         | transport  |
| ---------------------------------------- | ---------- |
| two CUDA workers on the same GPU         | cuda_ipc   |
| two CUDA workers on different GPUs       | nccl       |
| two CPU workers                          | socket (Unix-domain on one machine, else TCP) |
| a CPU worker and a CUDA one              | gloo (the CUDA end stages through pinned host memory) |

A job may force one transport for every edge (``transport=``), e.g. gloo between GPU hosts
without NCCL, or to measure one path against another; a forced choice that cannot work is refused.

The data-parallel replicas' gradient all-reduce (``replica_transport``) is a ring over sockets
(runtime/worker/transports/socket_ring.py) when every worker of the job is a CPU worker, unless
the job forces gloo; ZeRO's collectives (reduce-scatter, gathers) and CUDA workers' go through gloo.
"""

from __future__ import annotations

from itertools import combinations

from atoll.controller.cluster.registry import WorkerRecord
from atoll.core.dataflow import BATCH, Routes
from atoll.errors import InvalidInput

GROUP_TRANSPORTS = frozenset({"gloo", "nccl"})
"""Transports built as process groups: every rank of a job joins them, or none does."""


def same_gpu(a: WorkerRecord, b: WorkerRecord) -> bool:
    return a.host == b.host and bool(a.gpu_uuid) and a.gpu_uuid == b.gpu_uuid


def choose_transport(src: WorkerRecord, dst: WorkerRecord, forced: str = "auto") -> str:
    src_gpu, dst_gpu = src.device.startswith("cuda"), dst.device.startswith("cuda")
    if forced == "auto":
        if src_gpu and dst_gpu:
            return "cuda_ipc" if same_gpu(src, dst) else "nccl"  # NCCL refuses two ranks on one GPU
        return "gloo" if src_gpu or dst_gpu else "socket"
    if forced == "socket" and (src_gpu or dst_gpu):
        raise InvalidInput(
            f"transport 'socket' needs CPU workers at both ends of an edge: {src.describe()} and {dst.describe()}"
        )
    if forced not in ("gloo", "socket") and not (src_gpu and dst_gpu):
        raise InvalidInput(f"transport {forced!r} needs CUDA workers at both ends of an edge")
    if forced == "cuda_ipc" and not same_gpu(src, dst):
        raise InvalidInput(f"transport 'cuda_ipc' needs both ends on one GPU: {src.describe()} and {dst.describe()}")
    if forced == "nccl" and same_gpu(src, dst):
        raise InvalidInput(f"transport 'nccl' cannot join two ranks on one GPU ({src.describe()}, {dst.describe()})")
    return forced


def edge_transports(routes: Routes, workers: list[WorkerRecord], forced: str = "auto") -> list[dict]:
    """One entry per pair of stages that exchange tensors (a dataflow edge, or a tied parameter's
    gradients): the ranks at its ends and its transport ("local" when both ends are one rank)."""
    pairs = [(e.src, e.dst, e.spec.name, e.skips) for e in routes.flow.edges if e.src != BATCH]
    for t in routes.flow.tied:
        pairs += [(a, b, f"tied {t.name}", False) for a, b in combinations(t.stages, 2)]  # each holder with each
    out = []
    for src, dst, name, skip in pairs:
        a, b = routes.stage_ranks[src], routes.stage_ranks[dst]
        # two stages on one rank hand tensors over in memory (controller/compiler/lowering.py)
        transport = "local" if a == b else choose_transport(workers[a], workers[b], forced)
        out.append(
            {
                "edge": name,
                "from_stage": src,
                "to_stage": dst,
                "from_rank": a,
                "to_rank": b,
                "transport": transport,
                "skip": skip,
            }
        )
    return out


def peer_transports(edges: list[dict], ranks: int) -> dict[int, list[str]]:
    """Per rank: the transport towards each other rank ("" where no edge joins them)."""
    table = {r: [""] * ranks for r in range(ranks)}
    for e in edges:
        a, b, name = e["from_rank"], e["to_rank"], e["transport"]
        if a == b:
            continue
        for x, y in ((a, b), (b, a)):
            if table[x][y] not in ("", name):
                raise InvalidInput(f"ranks {a} and {b} would need two transports ({table[x][y]}, {name})")
            table[x][y] = name
    return table


def replica_transport(workers: list[WorkerRecord], data_parallel: int, zero: int, forced: str = "auto") -> str:
    """How the job's replicas average their gradients: "" (one replica), "socket" or "gloo"."""
    if data_parallel < 2:
        return ""
    cpu_only = not any(w.device.startswith("cuda") for w in workers)
    return "socket" if cpu_only and not zero and forced in ("auto", "socket") else "gloo"
