"""Admission: a job gets all its workers at once or waits, in arrival order, up to its deadline.

Placement (``Lifecycle.place``, controller/lifecycle.py) is all or nothing; a request it cannot meet now either
fails at once (``admission_timeout_s`` = 0, the default) or queues. The queue is served strictly in
arrival order: only its head tries to place, again whenever workers are released (a job closes or
fails, a worker registers), so a large request is not starved by smaller ones behind it. ``atoll
status`` shows the queue.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from atoll.errors import NotEnoughWorkers

T = TypeVar("T")


@dataclass(eq=False)
class Ticket:
    name: str
    ranks: int
    device: str
    islands: tuple[str, ...]
    exclusive: bool
    since: float = field(default_factory=time.monotonic)


class AdmissionQueue:
    def __init__(self, lock: threading.Lock):
        self._changed = threading.Condition(lock)
        self._queue: list[Ticket] = []

    def admit(self, ticket: Ticket, place: Callable[[], T], timeout_s: float) -> T:
        """``place()`` (raising NotEnoughWorkers when it cannot) once ``ticket`` heads the queue and
        the workers are there. Call with the lock held; it is released while waiting."""
        deadline = time.monotonic() + timeout_s
        self._queue.append(ticket)
        try:
            while True:
                ahead = self._queue.index(ticket)
                if ahead == 0:
                    try:
                        return place()
                    except NotEnoughWorkers as e:
                        if time.monotonic() >= deadline:
                            waited = f" (waited {timeout_s:g}s in the admission queue)" if timeout_s > 0 else ""
                            raise NotEnoughWorkers(f"{e}{waited}") from None
                elif time.monotonic() >= deadline:
                    raise NotEnoughWorkers(
                        f"{ticket.name}: still behind {ahead} earlier request(s) in the admission queue "
                        f"after {timeout_s:g}s"
                    )
                self._changed.wait(max(0.0, deadline - time.monotonic()))
        finally:
            self._queue.remove(ticket)
            self._changed.notify_all()

    def released(self) -> None:
        """Workers were freed or added: let the head try again. Call with the lock held."""
        self._changed.notify_all()

    def snapshot(self) -> list[Ticket]:
        return list(self._queue)
