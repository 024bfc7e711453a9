"""The data-parallel replicas' gradient all-reduce as a ring over the socket transport.

gloo's all-reduce between CPU processes runs the same ring (a reduce-scatter, then an all-gather,
n - 1 rounds each, every rank sending 2(n - 1)/n of the data), but through its own threads and
TCP loop: on this project's 2-core machine, 8 processes all-reducing 1.2 MB (the GPT example's
gradients, in 8 tensors) cost 7.0-7.8 ms of CPU per rank per all-reduce with gloo against 2.8-3.0
ms with this ring (``bench/all_reduce.py``, two rounds each, alternated); a bare ring of blocking
sockets in a script did it in 1.4-1.6 ms, so most of what is left is this module's Python. With
more workers than cores, that CPU is the step's time: DP=8 on the GPT example spent 253-267
against 293-313 ms of worker CPU per step, 6.9-7.4 against 5.8-6.4 steps/s.

Each ring connects a replica to its two neighbours only (sockets.py), and runs in the thread that
waits for it (the executor, at ALL_REDUCE_GRAD): an all-reduce handed over during the backward
starts when it is first waited for, after those handed over before it, on every replica in the
same order, since every replica runs the same plan. So it does not overlap the rest of the
backward as gloo's threads do; it costs a quarter of the CPU instead.
"""

from __future__ import annotations

import collections
import threading
import time

import torch

from atoll.worker.transports.gloo import DataPlaneError
from atoll.worker.transports.sockets import SocketTransport

SEND_BUFFER_BYTES = 4 << 20
"""Each ring socket's send buffer: a chunk that fits is written in one call, with no wait for the
neighbour to read (Linux's default, 208 KiB, splits the GPT example's 150 KiB chunks)."""


class _Reduction:
    """One all-reduce handed over, summed in place when first waited for."""

    def __init__(self, ring: SocketRing, tensors: list[torch.Tensor]):
        self.ring = ring
        self.tensors = tensors
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def wait(self, timeout_s: float) -> None:
        self.ring._run_until(self, time.monotonic() + timeout_s)


class SocketRing:
    """``all_reduce_sum`` across ``world_size`` CPU replicas, each connected to its neighbours."""

    name = "socket"

    def __init__(self, *, store, rank: int, world_size: int, host: str, timeout_s: float):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self._left, self._right = (rank - 1) % world_size, (rank + 1) % world_size
        self._sockets = SocketTransport(
            store=store,
            rank=rank,
            peers=sorted({self._left, self._right}),
            host=host,
            timeout_s=timeout_s,
            send_buffer_bytes=SEND_BUFFER_BYTES,
        )
        self._queue: collections.deque[_Reduction] = collections.deque()
        self._lock = threading.Lock()  # one thread runs the ring at a time
        self._broken = ""
        self._scratch = torch.empty(0)  # the incoming chunk, kept between all-reduces (the same sizes every step)

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> _Reduction:
        """Sum each tensor in place across the replicas (one ring for all of them), once waited for."""
        reduction = _Reduction(self, tensors)
        self._queue.append(reduction)
        return reduction

    def close(self) -> None:
        self._sockets.close()

    def _run_until(self, reduction: _Reduction, deadline: float) -> None:
        with self._lock:
            while not reduction.finished:
                if self._broken:
                    raise DataPlaneError(self._broken)
                head = self._queue[0]
                try:
                    self._reduce(head.tensors, deadline)
                except DataPlaneError as e:  # the replicas are out of step now: every later one fails too
                    self._broken = f"replica all-reduce failed earlier: {e}"
                    raise
                head.finished = True
                self._queue.popleft()

    def _reduce(self, tensors: list[torch.Tensor], deadline: float) -> None:
        n, rank = self.world_size, self.rank
        flat = torch.cat([t.reshape(-1) for t in tensors])
        chunks = flat.tensor_split(n)
        scratch = self._scratch_for(max(c.numel() for c in chunks), flat.dtype)
        for k in range(n - 1):  # reduce-scatter: after it, chunk rank + 1 holds every replica's sum
            mine, theirs = chunks[(rank - k) % n], chunks[(rank - k - 1) % n]
            incoming = scratch[: theirs.numel()]
            self._exchange(mine, incoming, k, deadline)
            theirs.add_(incoming)
        for k in range(n - 1):  # all-gather: pass the summed chunks round
            self._exchange(chunks[(rank + 1 - k) % n], chunks[(rank - k) % n], n - 1 + k, deadline)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def _scratch_for(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self._scratch.numel() < numel or self._scratch.dtype != dtype:
            self._scratch = torch.empty(numel, dtype=dtype)
        return self._scratch

    def _exchange(self, outgoing: torch.Tensor, incoming: torch.Tensor, tag: int, deadline: float) -> None:
        """Send ``outgoing`` to the right neighbour while receiving ``incoming`` from the left: the
        receive is posted first, so the send, written by this thread, reads it meanwhile."""
        received = self._sockets.recv(incoming, self._left, tag)
        sent = self._sockets.send(outgoing, self._right, tag, inline=True)
        received.wait(max(0.0, deadline - time.monotonic()))
        sent.wait(max(0.0, deadline - time.monotonic()))
