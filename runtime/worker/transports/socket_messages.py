"""What the socket transport (sockets.py) moves and hands back: the header before each tensor's
bytes, a writable view of any tensor's bytes, and the handles of sends and receives, which the
executor waits on (``wait(timeout_s)``) and an interleaver asks whether it would wait (``done()``).
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
import time

import torch

from atoll.worker.transports.gloo import DataPlaneError

HEADER = struct.Struct("<qq")  # tag, byte count
_EMPTY = memoryview(b"")


@functools.lru_cache(maxsize=1024)
def _memory(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def tensor_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, writable, whatever its dtype (bfloat16 has no buffer protocol). Cached
    by address and length: the receive buffers are the plan's, the same every step."""
    return _memory(tensor.data_ptr(), tensor.nbytes) if tensor.nbytes else _EMPTY


class Sent:
    """A send: complete once returned (the kernel has the bytes), or the reason it failed."""

    __slots__ = ("error",)

    def __init__(self, error: str = ""):
        self.error = error

    def done(self) -> bool:
        return True

    def wait(self, timeout_s: float) -> None:
        if self.error:
            raise DataPlaneError(self.error)


SENT = Sent()


class Queued:
    """A send that did not fit the socket at once: written in the background, in order."""

    __slots__ = ("what", "tensor", "views", "written", "error")

    def __init__(self, what: str, tensor: torch.Tensor, views: list[memoryview]):
        self.what = what
        self.tensor = tensor  # the views point into it: kept alive until written
        self.views = views
        self.written = threading.Event()
        self.error = ""

    def done(self) -> bool:
        return self.written.is_set()

    def wait(self, timeout_s: float) -> None:
        if not self.written.wait(timeout_s):
            raise DataPlaneError(f"{self.what} timed out after {timeout_s:g}s")
        if self.error:
            raise DataPlaneError(self.error)


class Message:
    """A message read before its receive was posted, held until then."""

    __slots__ = ("data", "finished", "error")

    def __init__(self, nbytes: int):
        self.data = bytearray(nbytes)
        self.finished = False  # set under the transport's lock
        self.error = ""  # the connection failed before the whole message came


class Recv:
    __slots__ = ("transport", "tensor", "what", "finished", "error", "early")

    def __init__(self, transport, tensor: torch.Tensor, what: str):
        self.transport = transport
        self.tensor = tensor
        self.what = what
        self.finished = False  # set under the transport's lock
        self.error = ""
        self.early: Message | None = None  # the message came first: copied in at wait

    def done(self) -> bool:
        """Whether ``wait`` would return at once (an interleaver asks before waiting in a thread)."""
        return self.finished or (self.early is not None and self.early.finished)

    def wait(self, timeout_s: float) -> None:
        early = self.early
        if not self.transport.progress_until(early or self, time.monotonic() + timeout_s):
            raise DataPlaneError(f"{self.what} timed out after {timeout_s:g}s")
        if early is not None:
            self.early = None
            self.error = early.error or self.error
            if not self.error and len(early.data) != self.tensor.nbytes:
                self.error = f"the message has {len(early.data)} bytes, the buffer {self.tensor.nbytes}"
            if not self.error:
                tensor_view(self.tensor)[:] = early.data
            self.finished = True
        if self.error:
            raise DataPlaneError(f"{self.what} failed: {self.error}")


def advance(views: list[memoryview], sent: int) -> None:
    """Drop the first ``sent`` bytes of ``views`` (sendmsg may write fewer than all)."""
    while views and sent >= len(views[0]):
        sent -= len(views[0])
        views.pop(0)
    if views and sent:
        views[0] = views[0][sent:]
