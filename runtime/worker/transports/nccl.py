"""NCCL: tensors between workers on different GPUs (same host or across hosts).

The job's NCCL group meets at the same store as its gloo group, under its own prefix. NCCL
refuses two ranks on one GPU, so the plan never chooses it for that case (cuda_ipc instead).
NCCL work is waited for by polling against the deadline, then ``Work.wait`` makes the current
stream wait on NCCL's stream, so the host does not block on the transfer itself.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from atoll.worker.transports.gloo import DataPlaneError


class _NcclHandle:
    __slots__ = ("_work", "_what", "tensor")

    def __init__(self, work, what: str, tensor: torch.Tensor):
        self._work, self._what, self.tensor = work, what, tensor

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            while not self._work.is_completed():
                if time.monotonic() > deadline:
                    raise DataPlaneError(f"{self._what} timed out after {timeout_s:g}s")
                time.sleep(20e-6)
            self._work.wait()
        except RuntimeError as e:
            raise DataPlaneError(f"{self._what} failed: {e}") from None


class NcclTransport:
    name = "nccl"

    def __init__(self, *, store: dist.Store, rank: int, world_size: int, timeout_s: float):
        if not dist.is_nccl_available():
            raise DataPlaneError("this worker's torch has no NCCL; the plan chose nccl for one of its edges")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        # NCCL meets lazily, at its first call: the store must live on. A worker's ControllerStore
        # makes its own prefixed copy; any other torch Store is wrapped.
        prefixed = getattr(store, "prefixed", None)
        self._store = prefixed("nccl/") if prefixed else dist.PrefixStore("nccl/", store)
        try:
            self.group = dist.ProcessGroupNCCL(self._store, rank, world_size, opts)
        except RuntimeError as e:
            raise DataPlaneError(f"rank {rank}/{world_size} could not join the job's NCCL group: {e}") from None

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> _NcclHandle:
        work = self.group.send([tensor], peer, tag)
        return _NcclHandle(work, f"nccl send to rank {peer} (tag {tag})", tensor)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> _NcclHandle:
        work = self.group.recv([tensor], peer, tag)
        return _NcclHandle(work, f"nccl receive from rank {peer} (tag {tag})", tensor)

    def all_reduce(self, tensor: torch.Tensor) -> _NcclHandle:
        """Sum over the group in place (for gradients of sharded or tied stages)."""
        return _NcclHandle(self.group.allreduce([tensor]), "nccl all-reduce", tensor)

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            try:
                group.shutdown()
            except (RuntimeError, AttributeError):
                pass
