"""Which transport carries each edge of a placed pipeline (ARCHITECTURE.md, Transports).

The choice follows from where the two ends run and is recorded in the plan, one transport per
edge. Only gloo exists in the runtime today; placement gives work to CPU workers only, so the
GPU rows below are the policy the GPU data plane will plug into, not paths that run yet.
"""

from __future__ import annotations

from controller.registry import WorkerRecord


def choose_transport(src: WorkerRecord, dst: WorkerRecord) -> str:
    src_gpu, dst_gpu = src.device.startswith("cuda"), dst.device.startswith("cuda")
    if src_gpu and dst_gpu:
        same_gpu = src.host == dst.host and src.gpu_uuid and src.gpu_uuid == dst.gpu_uuid
        return "cuda_ipc" if same_gpu else "nccl"  # NCCL refuses two ranks on one GPU
    return "gloo"  # CPU workers, and mixed CPU/GPU edges through host memory


def edge_transports(stage_ranks: list[int], workers: list[WorkerRecord]) -> list[dict]:
    """One entry per edge (stage s -> s+1): the ranks at its ends and its transport."""
    out = []
    for s in range(len(stage_ranks) - 1):
        a, b = stage_ranks[s], stage_ranks[s + 1]
        out.append({"edge": s, "from_rank": a, "to_rank": b, "transport": choose_transport(workers[a], workers[b])})
    return out
