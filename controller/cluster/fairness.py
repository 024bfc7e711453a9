"""Fair dispatch between jobs that share workers: weighted fair queueing of steps.

Every worker runs the steps of all its jobs in one gang order (jobs.py), so the order in which the
controller dispatches steps is the order in which the workers spend their time. A worker has at
most ``IN_FLIGHT`` steps dispatched and unfinished, whichever jobs they belong to (enough to
overlap the control plane with the run); further steps wait here. Among the waiting steps that
could go, the one whose job has the least virtual time goes first; dispatching a step advances
its job's virtual time by 1 / weight. A job arriving from idle starts at the least virtual time of
the busy jobs, so it banks no credit while away. Busy jobs sharing workers thus progress in proportion to their
weights: with equal weights, in turn.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Waiting:
    job_id: str
    workers: frozenset[str]
    weight: float
    arrival: int = field(default_factory=itertools.count().__next__)


class FairGate:
    IN_FLIGHT = 2

    def __init__(self):
        self._cond = threading.Condition()
        self._virtual: dict[str, float] = {}
        self._in_flight: dict[str, int] = {}
        self._workers: dict[str, frozenset[str]] = {}
        self._waiting: list[_Waiting] = []

    def _can_go(self, w: _Waiting) -> bool:
        """Fewer than IN_FLIGHT unfinished steps on every worker of ``w``'s job."""
        busy = sum(n for j, n in self._in_flight.items() if n and not self._workers[j].isdisjoint(w.workers))
        return busy < self.IN_FLIGHT

    def _ahead(self, me: _Waiting) -> bool:
        """Whether another step that could go, sharing a worker with ``me``, goes first."""
        mine = (self._virtual.get(me.job_id, 0.0), me.arrival)
        return any(
            (self._virtual.get(w.job_id, 0.0), w.arrival) < mine
            for w in self._waiting
            if w is not me and not w.workers.isdisjoint(me.workers) and self._can_go(w)
        )

    def enter(self, job_id: str, workers: frozenset[str], weight: float, steps: int = 1) -> None:
        """Block until this step of ``job_id`` (or these ``steps`` sent as one, which advance the
        job's virtual time as many steps do) may be dispatched; call ``leave`` when it finishes."""
        me = _Waiting(job_id, workers, weight)
        with self._cond:
            self._workers[job_id] = workers
            if not self._in_flight.get(job_id):  # idle until now: it banked no credit while away
                backlogged = {j for j, n in self._in_flight.items() if n} | {w.job_id for w in self._waiting}
                others = [self._virtual.get(j, 0.0) for j in backlogged if j != job_id]
                self._virtual[job_id] = max(self._virtual.get(job_id, 0.0), min(others, default=0.0))
            self._waiting.append(me)
            try:
                while not self._can_go(me) or self._ahead(me):
                    self._cond.wait()
            finally:
                self._waiting.remove(me)
            self._virtual[job_id] = self._virtual.get(job_id, 0.0) + steps / weight
            self._in_flight[job_id] = self._in_flight.get(job_id, 0) + 1
            self._cond.notify_all()

    def leave(self, job_id: str) -> None:
        with self._cond:
            self._in_flight[job_id] -= 1
            self._cond.notify_all()

    def forget(self, job_id: str) -> None:
        """The job is closed: drop its bookkeeping."""
        with self._cond:
            if not self._in_flight.get(job_id):
                for table in (self._in_flight, self._virtual, self._workers):
                    table.pop(job_id, None)
