"""A controller restarted on its state directory (controller/statedir.py) takes its jobs back.

At start, before it serves, it reads the directory: each recorded worker waits for its worker to
register again (``returning``; its id goes to no other worker), and each job that was ready is
compiled again from its recorded program and waits for its workers (RECOVERING): calls on it wait
too. Workers whose heartbeats now go unanswered register again, each reporting the jobs it still
holds and how far their steps got (``HeldJob``). Once every worker of a job is back with the same
load of it (its data-plane namespace), and has sent its first heartbeat with the new key (so it
holds that key: a call sooner could be refused), the job is READY again where it was, its
data-plane groups untouched:

- its next step number is the one after the slowest worker's last finished step: the client
  sends its unanswered steps again (``StepRequest.retry``), a worker that ran one answers from its
  ledger (atoll.worker.ledger), one that did not runs it; so no step runs twice;
- its count of training steps is the one at load plus the furthest worker's count since.

A worker that comes back without the job (it was restarted), or does not come back within the
heartbeat timeout (declared dead as a silent worker), is a lost worker: an auto_resume job is
restored from its checkpoint and recorded journal on live workers before its next step
(controller/resume.py), any other job fails with the cause.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from atoll._rpc import atoll_pb2 as pb
from atoll.controller.cluster.leases import Leases
from atoll.controller.cluster.registry import Registry, WorkerRecord
from atoll.controller.cluster.rendezvous import Rendezvous
from atoll.controller.jobs import Job, JobState, JobTable
from atoll.controller.lifecycle import Lifecycle
from atoll.controller.loading import Loader
from atoll.controller.statedir import JobRow, MemoryState, Recorded

log = logging.getLogger("atoll.controller")


@dataclass(kw_only=True, eq=False)
class Recovery:
    jobs: JobTable
    registry: Registry
    rendezvous: Rendezvous
    leases: Leases
    lifecycle: Lifecycle
    loader: Loader
    """Compiles each recorded program again, as a submission is."""
    records: MemoryState
    _returned: dict[str, dict[str, pb.HeldJob]] = field(default_factory=dict, init=False)
    """Per recovering job, its workers back so far and what each reported."""
    _unheard: set[str] = field(default_factory=set, init=False)
    """Workers back whose first heartbeat with the new key has not come: until it does, the
    worker may not hold that key yet, and a call carrying it would be refused."""
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def start(self, recorded: Recorded) -> None:
        """Wait for the workers of what the state directory ``recorded`` (at start, before serving)."""
        if not recorded.workers and not recorded.jobs:
            return
        started = time.monotonic()
        self.registry.expect([w for w in recorded.workers if w.alive], {w.worker_id for w in recorded.workers})
        self.jobs.recovered(recorded.next_job, recorded.closed)
        for row in recorded.jobs:
            job = self._job(row)
            with self.jobs.lock:
                self.jobs.add(job)
                if job.state is JobState.RECOVERING:
                    for w in job.workers:
                        w.jobs.add(job.job_id)
            if job.session:  # its client has a lease's time to reconnect
                self.leases.renew(job.session)
        waiting = [j.job_id for j in self.jobs.all() if j.state is JobState.RECOVERING]
        log.warning(
            "recovered from %s in %.2f s: %d workers to come back, jobs waiting for them: %s",
            self.records.path,
            time.monotonic() - started,
            sum(w.returning for w in self.registry.all()),
            ", ".join(waiting) or "none",
        )

    def _job(self, row: JobRow) -> Job:
        compiled = self.loader.compile(pb.PipelineProgram.FromString(row.program))
        workers = [self.registry.get(w) for w in row.placement]
        job = Job(row.job_id, row.name, compiled, [w for w in workers if w is not None], row.report)
        job.islands, job.session, job.namespace = row.islands, row.session, row.namespace
        job.steps = job.steps_at_load = row.steps_at_load
        job.journal = [(seq, pb.StepRequest.FromString(request), loss) for seq, request, loss in row.journal]
        if job.journal:  # restored rather than taken back, it numbers on from its journal
            job.next_seq = job.journal[-1][0] + 1
        if row.state == JobState.FAILED.value:
            job.state, job.error, job.failed_at = JobState.FAILED, row.error, time.monotonic()
        elif row.state != JobState.READY.value or None in workers or not all(w.returning for w in workers):
            job.state, job.failed_at = JobState.FAILED, time.monotonic()
            job.error = "the controller restarted while the job was loading, or its workers were already gone"
            self.records.job_state(job.job_id, JobState.FAILED.value, job.error)
        else:
            job.state = JobState.RECOVERING
            self.rendezvous.open(row.namespace, row.secret)  # the workers' groups may meet there again
        return job

    def returned(self, record: WorkerRecord, held: list[pb.HeldJob]) -> list[str]:
        """``record``'s worker registered again, holding ``held``: the ids of those jobs it keeps."""
        held_by_id = {h.job_id: h for h in held}
        keep = []
        for job in self.jobs.on_worker(record):
            h = held_by_id.get(job.job_id)
            same_load = h is not None and h.namespace == job.namespace
            if job.state is JobState.READY and job.broken and same_load:
                keep.append(job.job_id)  # its restore unloads it from here
            if job.state is not JobState.RECOVERING:
                continue
            if not same_load:
                self.lifecycle.lost_worker(job, f"{record.describe()} came back without it (the worker restarted)")
                continue
            keep.append(job.job_id)
            with self._lock:
                self._returned.setdefault(job.job_id, {})[record.worker_id] = h
                self._unheard.add(record.worker_id)
        return keep

    def heard(self, record: WorkerRecord) -> None:
        """A heartbeat with this controller's key: the worker holds the key, and its jobs whose
        workers are all back and heard are taken back."""
        with self._lock:
            if record.worker_id not in self._unheard:
                return
            self._unheard.discard(record.worker_id)
            ready = []
            for job in self.jobs.on_worker(record):
                back = self._returned.get(job.job_id, {})
                if len(back) == len(job.workers) and not self._unheard & set(back):
                    ready.append((job, list(back.values())))
        for job, reports in ready:
            self._adopt(job, reports)

    def _adopt(self, job: Job, reports: list[pb.HeldJob]) -> None:
        with job.order:
            if job.state is not JobState.RECOVERING:  # a worker was lost meanwhile
                return
            job.next_seq = min(h.last_done for h in reports) + 1
            job.counted_up_to = max(h.last_done for h in reports)
            job.steps = job.steps_at_load + max(h.train_steps for h in reports)
            job.loaded_at = time.monotonic()
            job.settle(JobState.READY)
        log.warning(
            "job %s taken back on %s: next step %d, %d training steps",
            job.job_id,
            ", ".join(w.worker_id for w in job.workers),
            job.next_seq,
            job.steps,
        )
