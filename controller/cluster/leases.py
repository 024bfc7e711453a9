"""Job leases: a job belongs to the client session that submitted it. Clients renew their
session while they live (``KeepAlive``); a job whose session has been silent for the lease
timeout is closed, so a client process that dies frees its workers. A job submitted ``detached``
belongs to no session and lives until someone closes it."""

from __future__ import annotations

import threading
import time


class Leases:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self.held_elsewhere = lambda session: False
        """Whether jobs outside the job table (parameter-server jobs) belong to a session: it is
        then not forgotten when the table's last job of that session closes."""

    def renew(self, session: str) -> None:
        with self._lock:
            self._seen[session] = time.monotonic()

    def expired(self, session: str) -> bool:
        """Whether ``session`` has been silent for longer than the timeout (unknown: expired)."""
        with self._lock:
            seen = self._seen.get(session)
        return seen is None or time.monotonic() - seen > self.timeout_s

    def forget(self, session: str) -> None:
        """Drop a session no job belongs to any more."""
        if self.held_elsewhere(session):
            return
        with self._lock:
            self._seen.pop(session, None)
