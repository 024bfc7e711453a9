"""Data-plane transports: how a tensor crosses from one worker to another.

One small interface, as Ray's channels have: ``send`` and ``recv`` post an operation and return
a handle whose ``wait(timeout_s)`` raises ``DataPlaneError`` on timeout or peer failure;
``close`` is idempotent and never blocks. gloo's blocking send waits for the matching receive,
so callers post both sides early and wait later (see ARCHITECTURE.md, Transports).
"""

from __future__ import annotations

import datetime
from typing import Protocol

import torch
import torch.distributed as dist


class DataPlaneError(RuntimeError):
    pass


class Handle(Protocol):
    def wait(self, timeout_s: float) -> None: ...


class Transport(Protocol):
    name: str

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle: ...

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle: ...

    def close(self) -> None: ...


class _GlooHandle:
    __slots__ = ("_work", "_what", "tensor")

    def __init__(self, work, what: str, tensor: torch.Tensor):
        self._work = work
        self._what = what
        self.tensor = tensor  # keeps a send's source alive until the peer has it

    def wait(self, timeout_s: float) -> None:
        try:
            self._work.wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            reason = "timed out" if "Timed out" in str(e) else "failed"
            raise DataPlaneError(f"{self._what} {reason} after at most {timeout_s:g}s: {e}") from None


class GlooTransport:
    """Point-to-point over a torch.distributed gloo group private to one job.

    The group is built directly (not through init_process_group) so one worker process can
    belong to the groups of several jobs at once.
    """

    name = "gloo"

    def __init__(self, *, store_address: str, prefix: str, rank: int, world_size: int, hostname: str, timeout_s: float):
        host, port = store_address.rsplit(":", 1)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        self._store = dist.PrefixStore(prefix, store)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
        try:
            self._group = dist.ProcessGroupGloo(self._store, rank, world_size, opts)
        except RuntimeError as e:
            raise DataPlaneError(
                f"rank {rank}/{world_size} could not join the gloo group at {store_address}/{prefix}: {e}"
            ) from None
        self.rank = rank

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> _GlooHandle:
        work = self._group.send([tensor], peer, tag)
        return _GlooHandle(work, f"send to rank {peer} (tag {tag})", tensor)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> _GlooHandle:
        work = self._group.recv([tensor], peer, tag)
        return _GlooHandle(work, f"receive from rank {peer} (tag {tag})", tensor)

    def close(self) -> None:
        self._group = None
        self._store = None
