"""Data-plane transports: how a tensor crosses from one worker to another.

One small interface, as Ray's channels have: ``send`` and ``recv`` post an operation and return
a handle whose ``wait(timeout_s)`` raises ``DataPlaneError`` on timeout or peer failure;
``close`` is idempotent and never blocks. gloo's blocking send waits for the matching receive,
so callers post both sides early and wait later (docs/architecture.md, Transports).
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
    """``wait`` may be called again once it returned (an interleaver waits in another thread
    first, runtime/worker/interleave.py): gloo's own wait on a send or receive waits for one more
    completion each time it is called, so a second call would wait for a message never sent."""

    __slots__ = ("_work", "_what", "tensor", "_done")

    def __init__(self, work, what: str, tensor: torch.Tensor):
        self._work = work
        self._what = what
        self.tensor = tensor  # keeps a send's source alive until the peer has it
        self._done = False

    def done(self) -> bool:
        """Whether ``wait`` has returned (gloo marks a send or receive complete only in its wait)."""
        return self._done

    def wait(self, timeout_s: float) -> None:
        if self._done:
            return
        try:
            self._work.wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            reason = "timed out" if "Timed out" in str(e) else "failed"
            raise DataPlaneError(f"{self._what} {reason} after at most {timeout_s:g}s: {e}") from None
        self._done = True


class _StagedRecv:
    """A gloo receive into pinned host memory, copied to the device buffer at ``wait``."""

    __slots__ = ("_inner", "_host", "_device_buf", "_copied")

    def __init__(self, inner: _GlooHandle, host: torch.Tensor, device_buf: torch.Tensor, copied: dict):
        self._inner, self._host, self._device_buf, self._copied = inner, host, device_buf, copied

    def wait(self, timeout_s: float) -> None:
        if self._inner.done():  # waited before, and copied then
            return
        self._inner.wait(timeout_s)
        self._device_buf.copy_(self._host, non_blocking=True)  # ordered on the compute stream
        done = torch.cuda.Event()
        done.record()
        self._copied[self._host.data_ptr()] = done  # the next receive into _host waits for this copy


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Pinned host copies of CUDA tensors, taken once the compute stream's queued work made them
    for gloo to send or reduce (its reduce-scatter and coalesced all-reduce refuse CUDA tensors;
    staging every operation one way keeps them alike)."""
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for host, t in zip(hosts, tensors):
        host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()  # gloo reads the host copies now
    return hosts


class _StagedCollective:
    """A gloo collective on host copies of CUDA tensors: ``wait`` copies its results back to the
    device tensors, ordered on the compute stream (the pinned allocator keeps each host buffer
    until its copy ran)."""

    __slots__ = ("_inner", "_back", "tensor")

    def __init__(self, inner: _GlooHandle, back: list[tuple[torch.Tensor, torch.Tensor]]):
        self._inner, self._back = inner, back
        self.tensor = inner.tensor

    def done(self) -> bool:
        return self._inner.done()

    def wait(self, timeout_s: float) -> None:
        if self._inner.done():  # waited before, and copied then
            return
        self._inner.wait(timeout_s)
        for host, device_tensor in self._back:
            device_tensor.copy_(host, non_blocking=True)


class GlooTransport:
    """Point-to-point over a torch.distributed gloo group private to one job.

    The group is built directly (not through init_process_group) so one worker process can
    belong to the groups of several jobs at once. CUDA tensors are staged through pinned host
    memory: a send copies to a pinned buffer and waits for that copy before gloo sends it; a
    receive lands in a pinned twin of its device buffer (allocated once per buffer) and is
    copied to the device, asynchronously on the compute stream, when the receiver waits for it.
    """

    name = "gloo"

    def __init__(self, *, store: dist.Store, rank: int, world_size: int, hostname: str, timeout_s: float):
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
        self._store = store  # a Python store must outlive the group that may call it (atoll.worker.rendezvous)
        try:
            self._group = dist.ProcessGroupGloo(store, rank, world_size, opts)
        except RuntimeError as e:
            raise DataPlaneError(f"rank {rank}/{world_size} could not join the job's gloo group: {e}") from None
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._pinned: dict[int, torch.Tensor] = {}  # device buffer's address -> its pinned twin
        self._copied: dict[int, torch.cuda.Event] = {}  # pinned twin's address -> its last copy out

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> _GlooHandle:
        if tensor.is_cuda:
            (tensor,) = _to_host([tensor])
        work = self._group.send([tensor], peer, tag)
        return _GlooHandle(work, f"send to rank {peer} (tag {tag})", tensor)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        target = tensor
        if tensor.is_cuda:
            target = self._pinned.get(tensor.data_ptr())
            if target is None:
                target = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                self._pinned[tensor.data_ptr()] = target
            previous = self._copied.pop(target.data_ptr(), None)
            if previous is not None:
                previous.synchronize()
        work = self._group.recv([target], peer, tag)
        handle = _GlooHandle(work, f"receive from rank {peer} (tag {tag})", target)
        return _StagedRecv(handle, target, tensor, self._copied) if tensor.is_cuda else handle

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> _GlooHandle | _StagedCollective:
        """Sum each tensor in place across the group (one coalesced collective)."""
        if tensors[0].is_cuda:
            hosts = _to_host(tensors)
            return _StagedCollective(self.all_reduce_sum(hosts), list(zip(hosts, tensors)))
        work = self._group.allreduce_coalesced(tensors)
        return _GlooHandle(work, f"all-reduce of {len(tensors)} tensors", tensors)

    def all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        """Reduce a tensor in place across the group ("sum" or "max") and wait for it (a
        tensor-parallel island's collective, atoll.core.collectives)."""
        if tensor.is_cuda:
            (host,) = _to_host([tensor])
            self.all_reduce(host, op)
            tensor.copy_(host, non_blocking=True)
            return
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        _GlooHandle(self._group.allreduce([tensor], opts), f"island all-reduce ({op})", tensor).wait(self.timeout_s)

    def all_gather_into(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """Every member's ``tensor`` into ``outputs`` (member order), waited for (an island's
        sequence-parallel gather, atoll.core.collectives)."""
        self.all_gather(outputs, tensor).wait(self.timeout_s)

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> _GlooHandle | _StagedCollective:
        """Every member's ``tensor`` into ``outputs`` (one per member, in member order)."""
        if tensor.is_cuda:
            (host,) = _to_host([tensor])
            host_outputs = [torch.empty(o.shape, dtype=o.dtype, pin_memory=True) for o in outputs]
            return _StagedCollective(self.all_gather(host_outputs, host), list(zip(host_outputs, outputs)))
        work = self._group.allgather([outputs], [tensor])
        return _GlooHandle(work, "all-gather", tensor)

    def reduce_scatter(self, output: torch.Tensor, inputs: list[torch.Tensor]) -> _GlooHandle | _StagedCollective:
        """Sum ``inputs[d]`` over the members into member d's ``output`` (ZeRO-2/3's gradients)."""
        if output.is_cuda:
            hosts = _to_host(inputs)
            host_output = torch.empty(output.shape, dtype=output.dtype, pin_memory=True)
            return _StagedCollective(self.reduce_scatter(host_output, hosts), [(host_output, output)])
        work = self._group.reduce_scatter([output], [inputs])
        return _GlooHandle(work, "reduce-scatter", output)

    def close(self) -> None:
        self._group = None
        self._pinned.clear()
        self._copied.clear()


class PeerTransports:
    """One transport per peer rank, as the plan chose for the edges between the two workers.
    Closing it closes every transport of the job on this worker (``owned``), also one that no
    edge of this rank uses, such as the collective gloo group."""

    name = "per-peer"

    def __init__(self, by_peer: dict[int, Transport], owned: list[Transport]):
        self.by_peer = by_peer
        self.owned = owned

    def _for(self, peer: int) -> Transport:
        try:
            return self.by_peer[peer]
        except KeyError:
            raise DataPlaneError(f"the plan gives no transport towards rank {peer}") from None

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        return self._for(peer).send(tensor, peer, tag)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        return self._for(peer).recv(tensor, peer, tag)

    def close(self) -> None:
        for transport in self.owned:
            transport.close()
