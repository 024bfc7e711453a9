"""Jobs (a loaded plan plus its live state), the controller's table of them, and the gang order of
their steps on shared workers."""

from __future__ import annotations

import contextlib
import enum
import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from typing import ClassVar

from atoll.controller.cluster.admission import AdmissionQueue, Ticket
from atoll.controller.cluster.dispatch import RELAY_ABOVE_WORKERS
from atoll.controller.cluster.registry import WorkerRecord
from atoll.controller.compiler.pipeline import CompiledPipeline
from atoll.controller.statedir import MemoryState
from atoll.errors import JobFailed, NotFound


class JobState(str, enum.Enum):
    LOADING = "loading"
    RECOVERING = "recovering"
    """Known from the state directory of a restarted controller, waiting for its workers to
    register again with it still loaded (controller/recovery.py)."""
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
    failed_at: float = 0.0
    """time.monotonic() when it failed."""
    next_seq: int = 1
    """The client's number of the next step to dispatch: steps go out in the client's order."""
    order: threading.Condition = field(default_factory=threading.Condition)
    loaded_at: float = field(default_factory=time.monotonic)
    session: str = ""
    """The client session whose lease keeps the job ("" for a detached job; controller/cluster/leases.py)."""
    islands: tuple[str, ...] = ()
    """Per worker index, the island it must be on ("" or absent: any); placement asks again on resume."""
    journal: list[tuple[int, object, float]] = field(default_factory=list)
    """An auto_resume job's training steps since its last checkpoint: (number, StepRequest, loss)."""
    namespace: str = ""
    """The job's namespace in the controller's rendezvous, one per load (controller/cluster/rendezvous.py)."""
    broken: str = ""
    """Why an auto_resume job must be restored before its next step ("" while it is whole)."""
    last_loss: float | None = None
    """The mean microbatch loss of the last training step (None before the first)."""
    last_memory: tuple[str, ...] = ()
    """Each worker's accounting (memory_json) of the last training step, parsed only when asked."""
    steps_at_load: int = 0
    """``steps`` when it was last loaded (0, or a checkpoint's step): a restarted controller adds
    the training steps its workers ran since."""
    base: str = ""
    """The id of the resident base job this job is attached to (controller/bases.py), or ""."""
    counted_up_to: int = 0
    """Steps numbered up to here were counted in ``steps`` before they ended here: a restarted
    controller counted them from its workers' reports (controller/recovery.py)."""
    worker_ids: frozenset[str] = field(init=False)

    def __post_init__(self):
        self.worker_ids = frozenset(w.worker_id for w in self.workers)

    @property
    def lane(self) -> str:
        """The job's own gang order on its workers ("" for their common one): a job attached to a
        resident base (JobConfig.base) runs its steps beside the other attached jobs' steps, not
        after them, so one's microbatches fill another's pipeline bubbles. Its steps stay in order
        among themselves, the same on every worker; it shares no process group or buffer with
        other jobs, so running beside them cannot deadlock."""
        return self.job_id if self.compiled.request.config.base else ""

    def move_to(self, workers: list[WorkerRecord]) -> None:
        """Run on ``workers`` from now on (index = worker index, as at placement)."""
        self.workers = workers
        self.worker_ids = frozenset(w.worker_id for w in workers)

    @property
    def auto_resume(self) -> bool:
        return self.compiled.request.config.auto_resume

    @property
    def dispatch_mode(self) -> str:
        """How a step goes out: "direct", "relay" or "sequential" (JobConfig.dispatch)."""
        mode = self.compiled.request.config.dispatch
        if mode == "parallel":
            return "relay" if len(self.workers) > RELAY_ABOVE_WORKERS else "direct"
        return mode

    @property
    def exclusive(self) -> bool:
        return self.compiled.request.config.exclusive

    @property
    def weight(self) -> float:
        return self.compiled.request.config.weight

    @property
    def predicted_peak_bytes(self) -> int:
        """The plan's largest per-rank predicted peak."""
        return max((int(m["total"]) for m in self.report.get("predicted_memory", {}).values()), default=0)

    @property
    def measured_peak_bytes(self) -> int:
        """The largest per-worker peak the workers measured in the last training step (0: none yet)."""
        peak = 0
        for text in self.last_memory:
            try:
                peak = max(peak, int(json.loads(text)["peak"]["total"]))
            except (ValueError, KeyError, TypeError):  # a worker's accounting is for show
                continue
        return peak

    def stepped(self, mode: str, loss: float, replies: list) -> None:
        """A step ended well: a training step's loss and the workers' accounting (RunStepReply,
        in worker order) are kept for status."""
        if mode == "train":
            self.last_loss, self.last_memory = loss, tuple(r.memory_json for r in replies)

    def count(self, seq: int, mode: str) -> None:
        """Step ``seq`` ended well: a training step adds to ``steps``, once (call holding ``order``)."""
        if mode == "train" and seq > self.counted_up_to:
            self.steps += 1

    def fail(self, reason: str) -> bool:
        """Mark the job failed; False when it had already failed or was closed."""
        if self.state not in (JobState.LOADING, JobState.READY, JobState.RECOVERING):
            return False
        self.error, self.failed_at = reason, time.monotonic()
        if self.state is JobState.RECOVERING:  # calls may wait for it (no step holds its order yet)
            self.settle(JobState.FAILED)
        else:  # not under ``order``: a step may hold it while its worker's death is handled
            self.state = JobState.FAILED
        return True

    def settle(self, state: JobState) -> None:
        """Leave RECOVERING for ``state``: the steps waiting for it go on (``JobTable.ready``)."""
        with self.order:
            self.state = state
            self.order.notify_all()


class GangScheduler:
    """Every worker runs the ordered work of all jobs placed on it in one sequence, the same on
    every worker of the island.

    Each ordered call (LoadPlan, RunStep, GetState) gets the worker's next position; the positions
    of one dispatch are taken together under one lock, so two jobs sharing workers are ordered the
    same way on all of them (interleaving them differently on two workers would deadlock their
    data-plane exchanges). Workers run calls strictly by position (atoll.worker.turnstile), so the
    controller can send step k+1 while step k still runs: dispatch is asynchronous.

    Each call also carries a floor: the worker's lowest position whose call has not yet ended at
    the controller. A position below it that never reached the worker (its relaying worker died,
    say) will never come, so the worker skips it at once instead of waiting out its deadline.
    """

    def __init__(self):
        self._next: dict[tuple[str, str], int] = {}  # per (worker, lane): the next position
        self._open: dict[tuple[str, str], set[int]] = {}  # positions handed out whose calls have not ended
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def positions(self):
        """Within the block, ``take(calls, lane)`` gives each call (controller/cluster/dispatch.py,
        ``Call``) its worker's next position in ``lane`` and its floor, all atomically."""
        with self._lock:
            yield self._take

    def _take(self, calls: list, lane: str = "") -> None:
        for call in calls:
            key = (call.worker.worker_id, lane)
            seq = self._next.get(key, 1)
            self._next[key] = seq + 1
            open_ = self._open.setdefault(key, set())
            open_.add(seq)
            call.gang_lane, call.gang_seq, call.gang_floor = lane, seq, min(open_)

    def ended(self, calls: list) -> None:
        """These calls (each holding its ``gang_seq`` in its ``gang_lane``, see Job.lane) have
        ended: answered, failed or timed out."""
        with self._lock:
            for call in calls:
                open_ = self._open.get((call.worker.worker_id, call.gang_lane))
                if open_ is not None:
                    open_.discard(call.gang_seq)


class JobTable:
    """The controller's jobs: those it holds, the ids of those closed (a closed job's plan and
    weights are dropped, its id is kept to say so), and the requests queued for workers.

    ``lock`` is the controller's one lock: placing a job and the bookkeeping after it are one
    decision, so the methods marked "lock held" are called inside ``with table.lock`` by a caller
    that makes more of that decision; the others take it themselves."""

    RECOVERY_WAIT_S: ClassVar[float] = 60.0
    """How long a call waits for a recovering job (its workers register again within seconds,
    or are declared dead after the heartbeat timeout)."""

    def __init__(self, records: MemoryState):
        self.lock = threading.Lock()
        self.admission = AdmissionQueue(self.lock)
        self.records = records
        """The state directory: job numbers and closed jobs are recorded there."""
        self._jobs: dict[str, Job] = {}
        self._closed: set[str] = set()
        self._ids = itertools.count()

    def recovered(self, next_id: int, closed: frozenset[str]) -> None:
        """A restarted controller's numbering and closed jobs, from its state directory."""
        self._ids, self._closed = itertools.count(next_id), set(closed)

    def new_id(self) -> str:
        """(lock held)"""
        number = next(self._ids)
        self.records.next_job(number + 1)
        return f"job{number}"

    def add(self, job: Job) -> None:
        """(lock held)"""
        self._jobs[job.job_id] = job

    def exclusive_ids(self) -> set[str]:
        """The jobs that keep their workers to themselves (lock held)."""
        return {jid for jid, j in self._jobs.items() if j.exclusive and j.state is not JobState.FAILED}

    def get(self, job_id: str) -> Job:
        with self.lock:
            job = self._jobs.get(job_id)
            closed = job_id in self._closed
        if job is None:
            raise NotFound(f"job {job_id!r} was closed" if closed else f"unknown job {job_id!r}")
        return job

    def ready(self, job_id: str) -> Job:
        job = self.get(job_id)
        if job.state is JobState.RECOVERING:  # a restarted controller takes it back in seconds
            with job.order:
                job.order.wait_for(lambda: job.state is not JobState.RECOVERING, self.RECOVERY_WAIT_S)
        if job.state is JobState.FAILED:
            raise JobFailed(f"job {job_id} has failed and must be submitted again: {job.error}")
        if job.state is not JobState.READY:
            raise JobFailed(f"job {job_id} is {job.state.value}")
        return job

    def is_closed(self, job_id: str) -> bool:
        with self.lock:
            return job_id in self._closed

    def all(self) -> list[Job]:
        with self.lock:
            return list(self._jobs.values())

    def on_worker(self, record: WorkerRecord) -> list[Job]:
        with self.lock:
            return [j for j in self._jobs.values() if record in j.workers]

    def snapshot(self) -> tuple[list[Job], list[Ticket]]:
        """The jobs and the queue, as of one moment."""
        with self.lock:
            return list(self._jobs.values()), self.admission.snapshot()

    def queue_length(self) -> int:
        with self.lock:
            return len(self.admission.snapshot())

    def released(self) -> None:
        """Workers were freed or added: a queued request may fit now."""
        with self.lock:
            self.admission.released()

    def remove(self, job: Job) -> set[str]:
        """Drop a closed job, keeping its id; returns the client sessions that still hold a job."""
        with self.lock:
            self._jobs.pop(job.job_id, None)
            self._closed.add(job.job_id)
            held = {j.session for j in self._jobs.values()}
        self.records.job_closed(job.job_id)
        return held
