"""CUDA IPC: tensors between worker processes that share one GPU, copied device to device.

NCCL refuses two ranks on one GPU, and gloo goes through host memory. Here the receiver owns one
device region holding all its receive buffers, allocated once at load and exported once; the
sender opens it and copies each tensor straight into the right buffer (one device-to-device copy,
no host round trip). See docs/gpu_data_plane.md for the protocol; in short:

- receiver, at ``recv`` (the k-th use of buffer i): marks buffer i *free* for use k on its compute
  stream (the buffer's old contents may still be read by queued kernels), then sends
  READY(tag, i, k) to the sender;
- sender, when both its ``send(tag)`` and READY(tag, i, k) have arrived: on its communication
  stream, waits for the source's producer and for *free* use k, copies, marks buffer i *filled*
  for use k, then sends FILLED(tag);
- receiver, at ``wait``: waits (with a deadline) for FILLED(tag), then makes its compute stream
  wait for *filled* use k. The host never blocks on the GPU.

The marks are GPU-side, per buffer, in one of two orderings (``ordering``):

- ``flags`` (where the driver has them, outside MPS): two 32-bit counters per buffer in the
  receiver's exported memory, written and awaited by the GPU itself (``cuStreamWriteValue32``
  and ``cuStreamWaitValue32``, "wait until the counter is at least k"). On an H200, 64 MB
  transfers between two processes ran at 0.64 of a copy inside one process, 0.41 with events
  (on another H200, whose host was slower, 0.37 to 0.43, then 0.48 and 0.55 with the copy queued
  through the driver);
- ``events``: two interprocess CUDA events per buffer, recorded by one process and awaited by
  the other's stream (``cuda_marks.py``; docs/gpu_data_plane.md has the measurements).

Either way a mark is per buffer and per use, so a late copy never waits for a later one. Notices
travel on a localhost socket per peer pair (cuda_ipc peers share a host by definition); a closed
socket fails every pending wait at once, and releases this process's GPU waits on the counters.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from dataclasses import dataclass

import torch

from atoll.worker.transports.cuda_marks import (
    FILLED_MARK,
    FREE_MARK,
    EventMarks,
    FlagMarks,
    StreamMemoryOps,
    b64,
    choose_ordering,
    export_region,
    open_region,
    unb64,
)
from atoll.worker.transports.gloo import DataPlaneError
from atoll.worker.transports.socket_setup import hang_up, recv_exact

_NOTICE = struct.Struct("<qqqq")  # kind, tag, buffer index, use of that buffer
_READY, _FILLED, _HELLO = 1, 2, 3


@dataclass(slots=True)
class _Peer:
    rank: int
    sock: socket.socket
    buffers: list[torch.Tensor]  # the peer's receive buffers, as byte views of its opened region
    typed: dict  # (index, dtype, shape) -> that buffer viewed as the tensor sent into it
    marks: FlagMarks | EventMarks  # the peer's marks, opened here
    send_lock: threading.Lock


class _Pending:
    """One side of a message: completes when its notice has been handled (or the peer fails)."""

    __slots__ = ("done", "error", "what", "tensor", "produced", "index", "use", "on_wait")

    def __init__(self, what: str, tensor: torch.Tensor):
        self.done = threading.Event()
        self.error = ""
        self.what = what
        self.tensor = tensor  # a send's source stays alive until its copy is queued
        self.produced: torch.cuda.Event | None = None
        self.index = -1
        self.use = 0
        self.on_wait = None

    def wait(self, timeout_s: float) -> None:
        if not self.done.wait(timeout_s):
            raise DataPlaneError(f"{self.what} timed out after {timeout_s:g}s")
        if self.error:
            raise DataPlaneError(f"{self.what} failed: {self.error}")
        if self.on_wait is not None:
            self.on_wait(self)


class CudaIpcTransport:
    """Point-to-point between workers on one GPU. ``buffers`` are views of ``region`` (this rank's
    receive buffers, in the plan's order); ``recv`` accepts only those. ``ordering``: see the
    module's docstring (``choose_ordering``); every peer must use the same."""

    name = "cuda_ipc"

    def __init__(
        self,
        *,
        store,
        rank: int,
        peers: list[int],
        region: torch.Tensor,
        buffers: list[torch.Tensor],
        timeout_s: float,
        ordering: str | None = None,
    ):
        self.rank = rank
        self.ordering = choose_ordering(ordering)
        self.device = region.device
        ops = StreamMemoryOps.load()
        self._driver_copy = ops if ops is not None and ops.can_copy else None
        self._lock = threading.Lock()
        self._closed = False
        self._broken = ""
        base = region.data_ptr()
        self._index = {b.data_ptr(): i for i, b in enumerate(buffers)}
        self._uses = [0] * len(buffers)  # per buffer: receives posted into it so far
        self._awaited: dict[int, int] = {}  # flags: buffer -> last use this process's GPU awaits filled
        self._region = region  # exported to the peers: held as long as they may write into it
        self._sends: dict[tuple[int, int], _Pending] = {}  # (peer, tag) -> send waiting for READY
        self._ready: dict[tuple[int, int], tuple[int, int]] = {}  # (peer, tag) -> READY's (buffer, use), no send yet
        self._recvs: dict[tuple[int, int], _Pending] = {}  # (peer, tag) -> receive waiting for FILLED
        self._peers: dict[int, _Peer] = {}
        self._on_comm = threading.local()  # set in reader threads, whose current stream is the comm stream
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(timeout_s)
        info = {
            "port": listener.getsockname()[1],
            "region": export_region(region),
            "buffers": [(b.data_ptr() - base, b.nbytes) for b in buffers],
            "ordering": self.ordering,
        }
        if self.ordering == "flags":  # choose_ordering picked flags only where ops loaded
            counters = torch.zeros(2 * max(1, len(buffers)), dtype=torch.int32, device=self.device)
            self._marks = FlagMarks(ops, counters, len(buffers))
            info["counters"] = export_region(counters)
            # a copy's stream waits on a peer's counter: if that peer dies first, the wait never
            # ends, so the stream is this transport's own, reused after close only if healthy
            self._comm = ops.take_stream(self.device)
            self._release_stream = torch.cuda.Stream(self.device)  # frees this process's own waits on failure
        else:
            self._comm = torch.cuda.Stream(self.device)
            self._marks = EventMarks(
                [torch.cuda.Event(interprocess=True) for _ in buffers],
                [torch.cuda.Event(interprocess=True) for _ in buffers],
            )
            info["events"] = [[b64(e.ipc_handle()) for e in events] for events in self._marks.events]
        torch.cuda.current_stream(self.device).synchronize()  # the counters' zeros are written before a peer reads them
        socks: dict[int, socket.socket] = {}
        try:
            store.set(f"cuda_ipc/{rank}", json.dumps(info))
            for p in sorted(x for x in peers if x < rank):  # the higher rank connects
                port = json.loads(store.get(f"cuda_ipc/{p}"))["port"]
                s = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
                s.sendall(_NOTICE.pack(_HELLO, rank, 0, 0))
                socks[p] = s
            for _ in [x for x in peers if x > rank]:
                s, _addr = listener.accept()
                s.settimeout(timeout_s)
                _kind, p, _, _ = _NOTICE.unpack(recv_exact(s, _NOTICE.size))
                socks[p] = s
            for p, s in socks.items():
                s.settimeout(None)  # the reader blocks; close() shuts the socket down to end it
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                peer_info = json.loads(store.get(f"cuda_ipc/{p}"))
                if peer_info["ordering"] != self.ordering:
                    raise ValueError(
                        f"rank {p} orders transfers by {peer_info['ordering']}, this rank by {self.ordering}"
                    )
                self._peers[p] = _Peer(
                    rank=p,
                    sock=s,
                    buffers=_views(open_region(peer_info["region"]), peer_info["buffers"]),
                    typed={},
                    marks=self._open_marks(peer_info),
                    send_lock=threading.Lock(),
                )
        except (OSError, RuntimeError, KeyError, ValueError) as e:
            for s in socks.values():
                s.close()
            raise DataPlaneError(f"rank {rank} could not open CUDA IPC with ranks {sorted(peers)}: {e}") from None
        finally:
            listener.close()
        self._readers = [
            threading.Thread(target=self._read, args=(peer,), name=f"cuda-ipc-{peer.rank}", daemon=True)
            for peer in self._peers.values()
        ]
        for reader in self._readers:
            reader.start()

    # ------------------------------------------------------------------ the Transport interface

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> _Pending:
        if tensor.device != self.device:
            raise DataPlaneError(f"cuda_ipc send to rank {peer}: tensor is on {tensor.device}, not {self.device}")
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        pending = _Pending(f"cuda_ipc send to rank {peer} (tag {tag})", tensor)
        pending.produced = torch.cuda.Event()
        pending.produced.record()  # on the compute stream: the copy waits for the kernels that made it
        tensor.record_stream(self._comm)  # the allocator must not reuse it before the copy ran
        with self._lock:
            self._check()
            ready = self._ready.pop((peer, tag), None)
            if ready is None:
                self._sends[(peer, tag)] = pending
        if ready is not None:
            self._copy(peer, tag, *ready, pending)
        return pending

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> _Pending:
        index = self._index.get(tensor.data_ptr())
        if index is None:
            raise DataPlaneError(f"cuda_ipc receive from rank {peer}: not one of this rank's receive buffers")
        pending = _Pending(f"cuda_ipc receive from rank {peer} (tag {tag})", tensor)
        self._uses[index] += 1
        pending.index, pending.use = index, self._uses[index]
        pending.on_wait = self._consume
        # queued readers of the old contents finish before the peer writes
        self._marks.mark(FREE_MARK, torch.cuda.current_stream(self.device), index, pending.use)
        with self._lock:
            self._check()
            self._recvs[(peer, tag)] = pending
        self._notify(peer, _READY, tag, index, pending.use)
        return pending

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._fail_all_locked("transport closed")
        for peer in self._peers.values():
            hang_up(peer.sock)
        # A shut-down socket ends its reader at once; joining (bounded) keeps a reader from
        # touching CUDA while the process exits. Dropping the peers releases their opened
        # regions and events now, while the peers (their producers) are still alive.
        for reader in self._readers:
            if reader is not threading.current_thread():
                reader.join(timeout=2.0)
        self._peers.clear()
        if self.ordering == "flags" and not self._broken:
            self._marks.ops.give_back(self._comm)

    # ------------------------------------------------------------------ internals

    def _open_marks(self, info: dict) -> FlagMarks | EventMarks:
        """A peer's marks, as this process writes and awaits them."""
        if self.ordering == "flags":
            counters = open_region(info["counters"]).view(torch.int32)
            return FlagMarks(StreamMemoryOps.load(), counters, len(info["buffers"]))
        free, filled = ([torch.cuda.Event.from_ipc_handle(self.device, unb64(h)) for h in hs] for hs in info["events"])
        return EventMarks(free, filled)

    def _consume(self, pending: _Pending) -> None:
        """The compute stream waits for the copy (its FILLED notice has arrived)."""
        stream = torch.cuda.current_stream(self.device)
        if self.ordering != "flags":
            self._marks.await_mark(FILLED_MARK, stream, pending.index, pending.use)
            return
        with self._lock:
            self._awaited[pending.index] = pending.use
            broken = self._broken
        self._marks.await_mark(FILLED_MARK, stream, pending.index, pending.use)
        if broken:  # the peer's connection ended after its FILLED: _release ran already, so again
            self._release()

    def _release(self) -> None:
        """flags, on failure: set this rank's own *filled* counters to the last use its compute
        stream awaits, so no stream of the worker stays blocked for a sender that died before its
        copy ran (the step fails; the buffers' contents are undefined). Only this process's own
        memory is written: a peer's may be gone. A copy left waiting on a dead receiver's counter
        blocks only this transport's private stream."""
        with self._lock:
            awaited = dict(self._awaited)
            self._awaited.clear()
        try:
            for index, use in awaited.items():
                self._marks.mark(FILLED_MARK, self._release_stream, index, use)
        except (DataPlaneError, RuntimeError):
            pass  # best effort: the transport has failed already

    def _check(self) -> None:
        if self._broken:
            raise DataPlaneError(f"cuda_ipc on rank {self.rank}: {self._broken}")

    def _notify(self, peer: int, kind: int, tag: int, index: int, use: int = 0) -> None:
        p = self._peers.get(peer)
        if p is None:
            raise DataPlaneError(f"cuda_ipc on rank {self.rank}: rank {peer} is not a cuda_ipc peer")
        try:
            with p.send_lock:
                p.sock.sendall(_NOTICE.pack(kind, tag, index, use))
        except OSError as e:
            self._fail(f"rank {peer} unreachable ({e})")
            raise DataPlaneError(f"cuda_ipc on rank {self.rank}: rank {peer} unreachable ({e})") from None

    def _copy(self, peer: int, tag: int, index: int, use: int, pending: _Pending) -> None:
        """Push ``pending``'s tensor into the peer's buffer ``index`` (runs on the comm stream)."""
        p = self._peers.get(peer)
        if p is None:  # closed meanwhile
            pending.error = "transport closed"
            pending.done.set()
            return
        tensor = pending.tensor
        key = (index, tensor.dtype, tensor.shape)
        dst = p.typed.get(key)
        if dst is None:
            raw = p.buffers[index]
            if tensor.nbytes != raw.nbytes:
                pending.error = f"rank {peer}'s buffer {index} holds {raw.nbytes} bytes, the tensor has {tensor.nbytes}"
                pending.done.set()
                return
            dst = p.typed[key] = raw.view(tensor.dtype).view(tensor.shape)
        # Every torch call here costs host time per message, which bounds small transfers: the
        # reader threads keep the comm stream current instead of entering it per copy.
        if getattr(self._on_comm, "set", False):
            self._enqueue_copy(p, index, use, pending, dst)
        else:
            with torch.cuda.stream(self._comm):
                self._enqueue_copy(p, index, use, pending, dst)
        try:
            self._notify(peer, _FILLED, tag, index)
        except DataPlaneError as e:
            pending.error = str(e)
        pending.done.set()

    def _enqueue_copy(self, p: _Peer, index: int, use: int, pending: _Pending, dst: torch.Tensor) -> None:
        """On the comm stream: after the producer and the receiver's *free*, copy, then *filled*.
        The copy goes through the driver where it can: the thread that queues copies bounds the
        transfer rate, and torch's ``copy_`` costs it more host time (on an H200, 64 MB transfers
        ran at 0.48 and 0.55 of a raw copy through the driver, 0.37 to 0.43 through ``copy_``)."""
        pending.produced.wait(self._comm)
        p.marks.await_mark(FREE_MARK, self._comm, index, use)
        if self._driver_copy is not None:
            self._driver_copy.copy(self._comm, dst.data_ptr(), pending.tensor.data_ptr(), dst.nbytes)
        else:
            dst.copy_(pending.tensor)
        p.marks.mark(FILLED_MARK, self._comm, index, use)

    def _read(self, peer: _Peer) -> None:
        torch.cuda.set_device(self.device)
        torch.cuda.set_stream(self._comm)
        self._comm.query()  # binds the device's context to this thread for the driver calls (flags)
        self._on_comm.set = True
        try:
            while True:
                kind, tag, index, use = _NOTICE.unpack(recv_exact(peer.sock, _NOTICE.size))
                if kind == _READY:
                    with self._lock:
                        pending = self._sends.pop((peer.rank, tag), None)
                        if pending is None:
                            self._ready[(peer.rank, tag)] = (index, use)
                    if pending is not None:
                        self._copy(peer.rank, tag, index, use, pending)
                elif kind == _FILLED:
                    with self._lock:
                        pending = self._recvs.pop((peer.rank, tag), None)
                    if pending is not None:
                        pending.done.set()
        except (OSError, ConnectionError) as e:
            if not self._closed:
                self._fail(f"connection to rank {peer.rank} lost ({e or 'closed'})")

    def _fail(self, reason: str) -> None:
        with self._lock:
            if not self._broken:
                self._broken = reason
            self._fail_all_locked(reason)
        self._release()

    def _fail_all_locked(self, reason: str) -> None:
        for pending in [*self._sends.values(), *self._recvs.values()]:
            pending.error = reason
            pending.done.set()
        self._sends.clear()
        self._recvs.clear()


def _views(region: torch.Tensor, table: list) -> list[torch.Tensor]:
    return [region[offset : offset + nbytes] for offset, nbytes in table]
