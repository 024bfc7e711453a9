"""The controller's table of live remote values, and who is reading them.

A value lives on its holder from ``PutValue`` (or a forward step that keeps its output) until it is
freed. A step that names values is checked against this table when it is submitted, so a step
naming a freed value is refused there (``InvalidInput``), before any worker runs, and its job
stays usable. From then until the step has ended the step reads them: a free asked meanwhile takes
the value out of the table at once (later steps are refused) but reaches the holder only when the
last such step has ended, so a queued step never finds its input gone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from atoll.errors import InvalidInput


@dataclass(slots=True)
class _Entry:
    worker_id: str
    readers: int = 0
    freed: bool = False


class ValueTable:
    def __init__(self, free_on_holder: Callable[[str, str], None]):
        """``free_on_holder(value_id, worker_id)`` releases the tensor on its worker."""
        self._free_on_holder = free_on_holder
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def add(self, value_id: str, worker_id: str) -> None:
        with self._lock:
            self._entries[value_id] = _Entry(worker_id)

    def check(self, value_ids: Iterable[str]) -> None:
        """Raise InvalidInput naming the first value that is not live."""
        with self._lock:
            self._check(value_ids)

    def _check(self, value_ids: Iterable[str]) -> None:
        for value_id in value_ids:
            entry = self._entries.get(value_id)
            if entry is None or entry.freed:
                raise InvalidInput(f"remote value {value_id} was freed (or never made on this cluster)")

    def acquire(self, value_ids: list[str]) -> None:
        """A step reads these values: refuse it if one is not live, else keep them until ``release``."""
        with self._lock:
            self._check(value_ids)
            for value_id in value_ids:
                self._entries[value_id].readers += 1

    def release(self, value_ids: list[str]) -> None:
        """The step that acquired ``value_ids`` has ended: frees asked meanwhile go to the holders."""
        due = []
        with self._lock:
            for value_id in value_ids:
                entry = self._entries.get(value_id)
                if entry is None:
                    continue
                entry.readers -= 1
                if entry.freed and entry.readers == 0:
                    due.append((value_id, self._entries.pop(value_id).worker_id))
        for value_id, worker_id in due:
            self._free_on_holder(value_id, worker_id)

    def free(self, value_id: str) -> None:
        """Free now, or once the steps reading it have ended (idempotent)."""
        with self._lock:
            entry = self._entries.get(value_id)
            if entry is None or entry.freed:
                return
            entry.freed = True
            if entry.readers:
                return
            del self._entries[value_id]
        self._free_on_holder(value_id, entry.worker_id)

    def drop_worker(self, worker_id: str) -> None:
        """The worker died: its values went with it."""
        with self._lock:
            for value_id in [v for v, e in self._entries.items() if e.worker_id == worker_id]:
                del self._entries[value_id]

    def __len__(self) -> int:
        with self._lock:
            return sum(not e.freed for e in self._entries.values())
