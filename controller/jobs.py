"""Jobs (a loaded plan plus its live state) and the gang order of their steps on shared workers."""

from __future__ import annotations

import contextlib
import enum
import threading
from dataclasses import dataclass, field

from controller.compiler import CompiledPipeline
from controller.registry import WorkerRecord


class JobState(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    CLOSED = "closed"


@dataclass(slots=True)
class Job:
    job_id: str
    name: str
    compiled: CompiledPipeline
    workers: list[WorkerRecord]
    """Index = pipeline rank."""
    report: dict
    state: JobState = JobState.LOADING
    steps: int = 0
    error: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """One step of a job at a time."""

    def fail(self, reason: str) -> None:
        if self.state in (JobState.LOADING, JobState.READY):
            self.state, self.error = JobState.FAILED, reason


class GangScheduler:
    """Every worker runs the steps of the jobs placed on it in one order, the same on all of them.

    A step takes the turn of every worker it uses, in one global order of worker ids, so two jobs
    sharing workers can never be interleaved differently on two of them (which would deadlock
    their data-plane exchanges); jobs on disjoint workers run concurrently.
    """

    def __init__(self):
        self._turns: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def _turn(self, worker_id: str) -> threading.Lock:
        with self._guard:
            return self._turns.setdefault(worker_id, threading.Lock())

    @contextlib.contextmanager
    def turn(self, worker_ids: list[str]):
        locks = [self._turn(w) for w in sorted(set(worker_ids))]
        with contextlib.ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock)
            yield
