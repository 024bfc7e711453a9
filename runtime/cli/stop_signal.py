"""SIGTERM and Ctrl-C (SIGINT) as a flag the main thread waits on: how ``atoll status --watch``
and the daemons (atoll.cli.daemons) hear that they should stop."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """Set by SIGTERM or SIGINT from the moment it is made until ``close``; ``wait`` returns at once
    when one comes.

    Two things shape it. CPython runs a signal's handler in the main thread between two of its
    bytecodes, wherever it is, so a handler that takes a lock the main thread may hold deadlocks:
    ``threading.Event.set`` does, since ``Event.wait`` holds the event's lock on its way into and
    out of its timed wait (the one way found for ``atoll status --watch`` to have been still
    running 20 s after its Ctrl-C in a CI run); this handler only sets a flag. And the kernel may
    deliver a process's signal to any of its threads (gRPC's, CUDA's); CPython then only flags
    it, and the handler waits for the main thread's next bytecode, which a blocked main thread
    never reaches (on a lent H100, py-spy found CUDA workers still in ``Event.wait()`` 3 s after
    their SIGTERM). So ``wait`` selects on the wakeup fd, which whichever thread took the signal
    writes."""

    LOOK_S = 1.0
    """The longest ``wait`` blocks without looking at the flag: should anything take the wakeup fd
    over, a signal is still seen within this."""

    def __init__(self) -> None:
        self.stopped = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._previous_fd = signal.set_wakeup_fd(self._wake_w)
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, *_) -> None:
        self.stopped = True

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until a stop signal has come or ``timeout_s`` seconds have passed (None: no
        limit); whether one has come."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.stopped:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            look = self.LOOK_S if left is None else min(left, self.LOOK_S)
            select.select([self._wake_r], [], [], look)
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 512)
        return self.stopped

    def close(self) -> None:
        """Give the signals back to the handlers and wakeup fd they had before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> StopSignal:
        return self

    def __exit__(self, *_) -> None:
        self.close()
