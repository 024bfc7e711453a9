"""The GPU side of a CUDA IPC transfer: the receiver's memory as plain data for its peers, and
the marks that order a copy after the receiver freed its buffer and the receiver's reads after the
copy (docs/gpu_data_plane.md, "cuda_ipc").

Two orderings. ``flags``: two 32-bit counters per buffer in the receiver's exported memory, written
and awaited by the GPU itself through the driver's stream memory operations (``cuStreamWriteValue32``
and ``cuStreamWaitValue32``: "wait until the counter is at least k"), so a mark costs no context's
turn on the GPU. ``events``: two interprocess CUDA events per buffer, the fallback where the driver
lacks stream memory operations, and the choice under MPS. Measured on an H200 through atoll's
transport: 64 MB transfers between two processes at 0.64 of a copy inside one process with
counters, 0.41 with events (0.89 with counters and no host notices at all).
"""

from __future__ import annotations

import base64
import ctypes
import os
import threading

import torch

from atoll.worker.transports.gloo import DataPlaneError

ORDERINGS = ("flags", "events")
ORDERING_ENV = "ATOLL_CUDA_IPC_ORDERING"
"""Forces an ordering ("flags" or "events") in every worker started with it set; unset: flags where
the driver has stream memory operations, else events."""


class StreamMemoryOps:
    """``cuStreamWaitValue32`` (wait until a 32-bit word in device memory is at least a value) and
    ``cuStreamWriteValue32`` (write one, after the stream's earlier work), from the driver API:
    torch exposes neither; and ``cuMemcpyDtoDAsync``, a copy queued with little host time. Loaded
    once; ``None`` where the driver lacks the first two."""

    _loaded: StreamMemoryOps | None | bool = False

    def __init__(self, lib: ctypes.CDLL, wait, write):
        self._lib, self._wait, self._write = lib, wait, write
        self._memcpy = getattr(lib, "cuMemcpyDtoDAsync_v2", None)
        if self._memcpy is not None:
            self._memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
            self._memcpy.restype = ctypes.c_int
        self._streams: dict[torch.device, list[torch.cuda.ExternalStream]] = {}
        self._streams_lock = threading.Lock()

    @classmethod
    def load(cls) -> StreamMemoryOps | None:
        if cls._loaded is False:
            cls._loaded = None
            try:
                lib = ctypes.CDLL("libcuda.so.1")
                fns = [
                    getattr(lib, f"{name}_v2", None) or getattr(lib, name)
                    for name in ("cuStreamWaitValue32", "cuStreamWriteValue32")
                ]
            except (OSError, AttributeError):
                return None
            for fn in fns:
                fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
                fn.restype = ctypes.c_int
            cls._loaded = cls(lib, *fns)
        return cls._loaded

    def take_stream(self, device: torch.device) -> torch.cuda.ExternalStream:
        """A non-blocking stream outside torch's pool, which hands its streams round to anyone: a
        stream left waiting for a counter that a failed peer never wrote must not reach a later
        job. ``give_back`` a healthy one for reuse; a stuck one is never given back (nor
        destroyed: the caching allocator may still record events on it for tensors sent)."""
        with self._streams_lock:
            free = self._streams.setdefault(device, [])
            if free:
                return free.pop()
        handle = ctypes.c_void_p()
        _checked("cuStreamCreate", self._lib.cuStreamCreate(ctypes.byref(handle), ctypes.c_uint(1)))  # 1: non-blocking
        return torch.cuda.ExternalStream(handle.value, device=device)

    def give_back(self, stream: torch.cuda.ExternalStream) -> None:
        with self._streams_lock:
            self._streams.setdefault(stream.device, []).append(stream)

    def wait_at_least(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        _checked("cuStreamWaitValue32", self._wait(stream.cuda_stream, address, value, 0))  # 0: GEQ

    def write(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        _checked("cuStreamWriteValue32", self._write(stream.cuda_stream, address, value, 0))  # 0: fenced

    @property
    def can_copy(self) -> bool:
        """Whether the driver has ``cuMemcpyDtoDAsync`` (``copy``)."""
        return self._memcpy is not None

    def copy(self, stream: torch.cuda.Stream, dst: int, src: int, nbytes: int) -> None:
        """``nbytes`` from device address ``src`` to ``dst``, queued on ``stream`` (``can_copy``).
        Less host time than torch's ``copy_``, which checks and dispatches per call."""
        _checked("cuMemcpyDtoDAsync", self._memcpy(dst, src, nbytes, stream.cuda_stream))


def _checked(what: str, code: int) -> None:
    if code != 0:
        raise DataPlaneError(f"cuda_ipc: {what} failed with CUDA driver error {code}")


def under_mps() -> bool:
    """Whether this process's CUDA context would go through an MPS server: a control daemon's pipe
    is where CUDA looks for one ($CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps)."""
    return os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps", "control"))


def choose_ordering(requested: str | None = None) -> str:
    """``requested`` (or $ATOLL_CUDA_IPC_ORDERING); else flags where the driver has stream memory
    operations and the process is no MPS client, else events. Under MPS a probe on an H200 saw
    counters complete transfers faster than the copies could run, so they are not trusted there."""
    requested = requested or os.environ.get(ORDERING_ENV) or None
    if requested is not None and requested not in ORDERINGS:
        raise DataPlaneError(f"cuda_ipc ordering {requested!r}: expected one of {', '.join(ORDERINGS)}")
    available = StreamMemoryOps.load() is not None
    if requested == "flags" and not available:
        raise DataPlaneError("cuda_ipc ordering 'flags' needs the driver's stream memory operations (libcuda.so.1)")
    return requested or ("flags" if available and not under_mps() else "events")


def b64(value) -> str | None:
    return None if value is None else base64.b64encode(bytes(value)).decode()


def unb64(value: str | None):
    return None if value is None else base64.b64decode(value)


def export_region(region: torch.Tensor) -> dict:
    """The plain-data IPC description of ``region``'s storage (no pickling on either side)."""
    shared = region.untyped_storage()._share_cuda_()
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = shared
    return {
        "device": device,
        "handle": b64(handle),
        "size": size,
        "offset": offset,
        "ref_handle": b64(ref_handle),
        "ref_offset": ref_offset,
        "event_handle": b64(event_handle),
        "event_sync": event_sync,
        "storage_offset": region.storage_offset(),
        "nbytes": region.nbytes,
    }


def open_region(info: dict) -> torch.Tensor:
    storage = torch.UntypedStorage._new_shared_cuda(
        info["device"],
        unb64(info["handle"]),
        info["size"],
        info["offset"],
        unb64(info["ref_handle"]),
        info["ref_offset"],
        unb64(info["event_handle"]),
        info["event_sync"],
    )
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{info['device']}")
    flat.set_(storage, info["storage_offset"], (info["nbytes"],))
    return flat


FREE_MARK, FILLED_MARK = 0, 1  # the two marks of a buffer


class FlagMarks:
    """A receiver's marks as counters: ``counters[i]`` is the last use of buffer i made free,
    ``counters[n + i]`` the last use filled; the GPU writes and awaits them."""

    def __init__(self, ops: StreamMemoryOps, counters: torch.Tensor, buffers: int):
        self.ops, self.counters, self.buffers = ops, counters, buffers  # counters: held while mapped
        self.base = counters.data_ptr()

    def mark(self, which: int, stream: torch.cuda.Stream, index: int, use: int) -> None:
        self.ops.write(stream, self.base + 4 * (which * self.buffers + index), use)

    def await_mark(self, which: int, stream: torch.cuda.Stream, index: int, use: int) -> None:
        self.ops.wait_at_least(stream, self.base + 4 * (which * self.buffers + index), use)


class EventMarks:
    """A receiver's marks as interprocess events, one per buffer and mark (re-recorded per use)."""

    def __init__(self, free: list[torch.cuda.Event], filled: list[torch.cuda.Event]):
        self.events = (free, filled)

    def mark(self, which: int, stream: torch.cuda.Stream, index: int, use: int) -> None:
        self.events[which][index].record(stream)

    def await_mark(self, which: int, stream: torch.cuda.Stream, index: int, use: int) -> None:
        stream.wait_event(self.events[which][index])
