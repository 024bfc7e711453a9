"""CUDA IPC: tensors between worker processes that share one GPU, copied device to device.

NCCL refuses two ranks on one GPU, and gloo goes through host memory. Here the receiver owns one
device region holding all its receive buffers, allocated once at load and exported once; the
sender opens it and copies each tensor straight into the right buffer (one device-to-device copy,
no host round trip). See docs/gpu_data_plane.md for the protocol; in short:

- receiver, at ``recv``: records buffer i's *free* event on its compute stream (the buffer's old
  contents may still be read by queued kernels), then sends READY(tag, i) to the sender;
- sender, when both its ``send(tag)`` and READY(tag, i) have arrived: on its communication stream,
  waits for the source's producer and for *free*, copies, records buffer i's *filled* event, then
  sends FILLED(tag);
- receiver, at ``wait``: waits (with a deadline) for FILLED(tag), then makes its compute stream
  wait on *filled*. The host never blocks on the GPU.

Events are per buffer, created by the receiver and opened by the sender, so a re-recorded event
never makes one copy wait on a later one. Notices travel on a localhost socket per peer pair
(cuda_ipc peers share a host by definition); a closed socket fails every pending wait at once.
"""

from __future__ import annotations

import base64
import json
import socket
import struct
import threading
from dataclasses import dataclass

import torch

from atoll.worker.transports.gloo import DataPlaneError

_NOTICE = struct.Struct("<qqq")  # kind, tag, buffer index
_READY, _FILLED, _HELLO = 1, 2, 3


def _b64(value) -> str | None:
    return None if value is None else base64.b64encode(bytes(value)).decode()


def _unb64(value: str | None):
    return None if value is None else base64.b64decode(value)


def export_region(region: torch.Tensor) -> dict:
    """The plain-data IPC description of ``region``'s storage (no pickling on either side)."""
    shared = region.untyped_storage()._share_cuda_()
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = shared
    return {
        "device": device,
        "handle": _b64(handle),
        "size": size,
        "offset": offset,
        "ref_handle": _b64(ref_handle),
        "ref_offset": ref_offset,
        "event_handle": _b64(event_handle),
        "event_sync": event_sync,
        "storage_offset": region.storage_offset(),
        "nbytes": region.nbytes,
    }


def open_region(info: dict) -> torch.Tensor:
    storage = torch.UntypedStorage._new_shared_cuda(
        info["device"],
        _unb64(info["handle"]),
        info["size"],
        info["offset"],
        _unb64(info["ref_handle"]),
        info["ref_offset"],
        _unb64(info["event_handle"]),
        info["event_sync"],
    )
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{info['device']}")
    flat.set_(storage, info["storage_offset"], (info["nbytes"],))
    return flat


@dataclass(slots=True)
class _Peer:
    rank: int
    sock: socket.socket
    buffers: list[torch.Tensor]  # the peer's receive buffers, as byte views of its opened region
    typed: dict  # (index, dtype, shape) -> that buffer viewed as the tensor sent into it
    free: list[torch.cuda.Event]
    filled: list[torch.cuda.Event]
    send_lock: threading.Lock


class _Pending:
    """One side of a message: completes when its notice has been handled (or the peer fails)."""

    __slots__ = ("done", "error", "what", "tensor", "produced", "index", "on_wait")

    def __init__(self, what: str, tensor: torch.Tensor):
        self.done = threading.Event()
        self.error = ""
        self.what = what
        self.tensor = tensor  # a send's source stays alive until its copy is queued
        self.produced: torch.cuda.Event | None = None
        self.index = -1
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
    receive buffers, in the plan's order); ``recv`` accepts only those."""

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
    ):
        self.rank = rank
        self.device = region.device
        self._lock = threading.Lock()
        self._closed = False
        self._broken = ""
        base = region.data_ptr()
        self._index = {b.data_ptr(): i for i, b in enumerate(buffers)}
        self._free = [torch.cuda.Event(interprocess=True) for _ in buffers]
        self._filled = [torch.cuda.Event(interprocess=True) for _ in buffers]
        self._comm = torch.cuda.Stream(self.device)
        self._region = region  # exported to the peers: held as long as they may write into it
        self._sends: dict[tuple[int, int], _Pending] = {}  # (peer, tag) -> send waiting for READY
        self._ready: dict[tuple[int, int], int] = {}  # (peer, tag) -> READY's buffer index, send not posted yet
        self._recvs: dict[tuple[int, int], _Pending] = {}  # (peer, tag) -> receive waiting for FILLED
        self._peers: dict[int, _Peer] = {}
        self._on_comm = threading.local()  # set in reader threads, whose current stream is the comm stream
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(timeout_s)
        info = {
            "port": listener.getsockname()[1],
            "region": export_region(region),
            "buffers": [(b.data_ptr() - base, b.nbytes) for b in buffers],
            "free": [_b64(e.ipc_handle()) for e in self._free],
            "filled": [_b64(e.ipc_handle()) for e in self._filled],
        }
        socks: dict[int, socket.socket] = {}
        try:
            store.set(f"cuda_ipc/{rank}", json.dumps(info))
            for p in sorted(x for x in peers if x < rank):  # the higher rank connects
                port = json.loads(store.get(f"cuda_ipc/{p}"))["port"]
                s = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
                s.sendall(_NOTICE.pack(_HELLO, rank, 0))
                socks[p] = s
            for _ in [x for x in peers if x > rank]:
                s, _addr = listener.accept()
                s.settimeout(timeout_s)
                _kind, p, _ = _NOTICE.unpack(_recv_exact(s, _NOTICE.size))
                socks[p] = s
            for p, s in socks.items():
                s.settimeout(None)  # the reader blocks; close() shuts the socket down to end it
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                peer_info = json.loads(store.get(f"cuda_ipc/{p}"))
                self._peers[p] = _Peer(
                    rank=p,
                    sock=s,
                    buffers=_views(open_region(peer_info["region"]), peer_info["buffers"]),
                    typed={},
                    free=[torch.cuda.Event.from_ipc_handle(self.device, _unb64(h)) for h in peer_info["free"]],
                    filled=[torch.cuda.Event.from_ipc_handle(self.device, _unb64(h)) for h in peer_info["filled"]],
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
            index = self._ready.pop((peer, tag), None)
            if index is None:
                self._sends[(peer, tag)] = pending
        if index is not None:
            self._copy(peer, tag, index, pending)
        return pending

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> _Pending:
        index = self._index.get(tensor.data_ptr())
        if index is None:
            raise DataPlaneError(f"cuda_ipc receive from rank {peer}: not one of this rank's receive buffers")
        pending = _Pending(f"cuda_ipc receive from rank {peer} (tag {tag})", tensor)
        pending.index = index
        pending.on_wait = self._consume
        self._free[index].record()  # queued readers of the old contents finish before the peer writes
        with self._lock:
            self._check()
            self._recvs[(peer, tag)] = pending
        self._notify(peer, _READY, tag, index)
        return pending

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._fail_all_locked("transport closed")
        for peer in self._peers.values():
            try:
                peer.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            peer.sock.close()
        # A shut-down socket ends its reader at once; joining (bounded) keeps a reader from
        # touching CUDA while the process exits. Dropping the peers releases their opened
        # regions and events now, while the peers (their producers) are still alive.
        for reader in self._readers:
            if reader is not threading.current_thread():
                reader.join(timeout=2.0)
        self._peers.clear()

    # ------------------------------------------------------------------ internals

    def _consume(self, pending: _Pending) -> None:
        torch.cuda.current_stream(self.device).wait_event(self._filled[pending.index])

    def _check(self) -> None:
        if self._broken:
            raise DataPlaneError(f"cuda_ipc on rank {self.rank}: {self._broken}")

    def _notify(self, peer: int, kind: int, tag: int, index: int) -> None:
        p = self._peers.get(peer)
        if p is None:
            raise DataPlaneError(f"cuda_ipc on rank {self.rank}: rank {peer} is not a cuda_ipc peer")
        try:
            with p.send_lock:
                p.sock.sendall(_NOTICE.pack(kind, tag, index))
        except OSError as e:
            self._fail(f"rank {peer} unreachable ({e})")
            raise DataPlaneError(f"cuda_ipc on rank {self.rank}: rank {peer} unreachable ({e})") from None

    def _copy(self, peer: int, tag: int, index: int, pending: _Pending) -> None:
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
            self._enqueue_copy(p, index, pending, dst)
        else:
            with torch.cuda.stream(self._comm):
                self._enqueue_copy(p, index, pending, dst)
        try:
            self._notify(peer, _FILLED, tag, index)
        except DataPlaneError as e:
            pending.error = str(e)
        pending.done.set()

    def _enqueue_copy(self, p: _Peer, index: int, pending: _Pending, dst: torch.Tensor) -> None:
        """On the current (comm) stream: after the producer and the receiver's *free*, copy, then *filled*."""
        pending.produced.wait()
        p.free[index].wait()
        dst.copy_(pending.tensor)
        p.filled[index].record()

    def _read(self, peer: _Peer) -> None:
        torch.cuda.set_device(self.device)
        torch.cuda.set_stream(self._comm)
        self._on_comm.set = True
        try:
            while True:
                kind, tag, index = _NOTICE.unpack(_recv_exact(peer.sock, _NOTICE.size))
                if kind == _READY:
                    with self._lock:
                        pending = self._sends.pop((peer.rank, tag), None)
                        if pending is None:
                            self._ready[(peer.rank, tag)] = index
                    if pending is not None:
                        self._copy(peer.rank, tag, index, pending)
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

    def _fail_all_locked(self, reason: str) -> None:
        for pending in [*self._sends.values(), *self._recvs.values()]:
            pending.error = reason
            pending.done.set()
        self._sends.clear()
        self._recvs.clear()


def _views(region: torch.Tensor, table: list) -> list[torch.Tensor]:
    return [region[offset : offset + nbytes] for offset, nbytes in table]


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        data += chunk
    return data
