"""The worker's side of gang scheduling: run the island's work in the controller's order.

The controller numbers every ordered call it sends to a worker (1, 2, 3, ...), the same way for
all workers of an island, and sends them as soon as it can (so step k+1 can be waiting while step
k runs). The worker runs them strictly in that order. Waiting behind a call that has arrived has
no deadline here (that call has its own); waiting for a number that has not arrived has one, after
which that number is skipped (its sender died or gave up), so the island never stalls. A call
also carries the controller's floor: numbers below it whose calls have ended at the controller
will never come, so they are skipped at once (controller/jobs.py, GangScheduler).
"""

from __future__ import annotations

import contextlib
import threading
import time

from atoll.errors import InvalidInput, WorkerUnavailable


class Turnstile:
    def __init__(self, missing_timeout_s: float = 60.0):
        self.missing_timeout_s = missing_timeout_s
        self._cond = threading.Condition()
        self._next = 1
        self._present: set[int] = set()
        self._floor = 1
        self._epoch = 0
        """Counts registrations: a call of an earlier one never takes a turn of the current one."""
        self._released: set[int] = set()
        self.skipped: list[int] = []

    def reset(self) -> None:
        """A new controller (re-registration) numbers from 1 again. Calls of the old numbering
        still waiting fail (their sender is gone); one running ends without moving the new order."""
        with self._cond:
            self._next, self._floor, self._epoch = 1, 1, self._epoch + 1
            self._present.clear()
            self._released.clear()
            self._cond.notify_all()

    def release(self, seq: int) -> bool:
        """Let the order go on past ``seq`` while its call still runs: its job was unloaded, and
        the call waits in the data plane for a peer that died or froze; it ends at that wait's
        deadline, and nobody reads its reply. False if ``seq`` is not the call running now."""
        with self._cond:
            if seq == 0 or self._next != seq or seq not in self._present:
                return False
            self._present.discard(seq)
            self._released.add(seq)
            self._next = seq + 1
            self._cond.notify_all()
            return True

    def _wait_for(self, seq: int, epoch: int) -> None:
        deadline = None
        while self._next != seq or self._epoch != epoch:
            if self._epoch != epoch:
                raise WorkerUnavailable(
                    f"gang position {seq} came from a controller this worker no longer serves "
                    f"(it registered again since); the call is dropped"
                )
            if self._next in self._present:  # the call ahead is here: it finishes or fails on its own
                deadline = None
                self._cond.wait()
                continue
            now = time.monotonic()
            deadline = deadline or now + self.missing_timeout_s
            if now >= deadline or self._next < self._floor:
                self.skipped.append(self._next)
                self._next += 1
                self._cond.notify_all()
                deadline = None
                continue
            self._cond.wait(deadline - now)

    @contextlib.contextmanager
    def turn(self, seq: int, floor: int = 0):
        """Hold the island's turn for ``seq``; seq 0 means unordered (runs at once, takes no turn).
        Numbers below ``floor`` that have not arrived are never coming."""
        if seq == 0:
            yield
            return
        with self._cond:
            self._floor = max(self._floor, min(floor, seq))
            if seq < self._next:
                raise InvalidInput(
                    f"gang position {seq} arrived after position {self._next - 1} ran "
                    f"(it was skipped as missing, or sent twice)"
                )
            epoch = self._epoch
            self._present.add(seq)
            self._cond.notify_all()
            try:
                self._wait_for(seq, epoch)
            except BaseException:
                if self._epoch == epoch:
                    self._present.discard(seq)
                raise
        try:
            yield
        finally:
            with self._cond:
                if seq in self._released:  # the order went on without it
                    self._released.discard(seq)
                elif self._epoch == epoch:
                    self._present.discard(seq)
                    self._next = seq + 1
                    self._cond.notify_all()
