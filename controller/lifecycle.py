"""A job's hold on its workers, from placement to its end: placing it, failing, unloading and
closing it, what a worker's death does to it, and closing the jobs of clients whose lease ran out."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from atoll._rpc import atoll_pb2 as pb
from atoll.controller import heap
from atoll.controller.cluster.admission import Ticket
from atoll.controller.cluster.dispatch import Call, Dispatcher
from atoll.controller.cluster.fairness import FairGate
from atoll.controller.cluster.leases import Leases
from atoll.controller.cluster.metrics import ControllerMetrics
from atoll.controller.cluster.placement import place
from atoll.controller.cluster.registry import Registry, WorkerRecord
from atoll.controller.cluster.rendezvous import Rendezvous
from atoll.controller.compiler.pipeline import CompiledPipeline
from atoll.controller.jobs import Job, JobState, JobTable
from atoll.controller.remote import RemoteValues
from atoll.controller.statedir import MemoryState
from atoll.errors import JobFailed, WorkerUnavailable

log = logging.getLogger("atoll.controller")


@dataclass(kw_only=True, eq=False)
class Lifecycle:
    jobs: JobTable
    registry: Registry
    """Placement chooses among its live workers."""
    dispatcher: Dispatcher
    rendezvous: Rendezvous
    """An unloaded job's data-plane namespace is closed."""
    gate: FairGate
    leases: Leases
    """A job is held by its client session's lease (controller/cluster/leases.py)."""
    metrics: ControllerMetrics
    values: RemoteValues
    """A dead worker's values went with it."""
    records: MemoryState
    """The state directory: a job's end and a worker's death are recorded there."""

    def admit(
        self, compiled: CompiledPipeline, islands: tuple[str, ...], session: str, on: list[WorkerRecord] | None = None
    ) -> Job:
        """Place a new job on workers, once the admission queue lets it (controller/cluster/admission.py),
        and enter it in the table and in its workers' load. ``on``: exactly these workers (a
        resident base's, for a job attached to it), by worker index."""
        cfg, topo = compiled.request.config, compiled.topology
        ticket = Ticket(cfg.name, topo.workers, cfg.device, islands, cfg.exclusive)

        def place() -> list[WorkerRecord]:
            return list(on) if on is not None else self.place(topo.workers, cfg.device, islands, cfg.exclusive)

        with self.jobs.lock:  # placement and bookkeeping are one decision
            workers = self.jobs.admission.admit(ticket, place, cfg.admission_timeout_s)
            job_id = self.jobs.new_id()
            job = Job(job_id, cfg.name or job_id, compiled, workers, report={}, islands=islands, session=session)
            if job.session:
                self.leases.renew(job.session)
            self.jobs.add(job)
            for w in workers:
                w.jobs.add(job_id)
        return job

    def place(self, ranks: int, device: str, islands: tuple[str, ...], exclusive: bool) -> list[WorkerRecord]:
        """Call with ``jobs.lock`` held: the choice and the bookkeeping after it are one decision."""
        return place(self.registry.live(), self.jobs.exclusive_ids(), ranks, device, islands, exclusive)

    def place_again(self, job: Job) -> None:
        """Move a job (unloaded, LOADING from now on) to live workers, least loaded first."""
        cfg, topo = job.compiled.request.config, job.compiled.topology
        with self.jobs.lock:
            job.state = JobState.LOADING
            workers = self.place(topo.workers, cfg.device, job.islands, cfg.exclusive)
            job.move_to(workers)
            for w in workers:
                w.jobs.add(job.job_id)

    def worker_died(self, record: WorkerRecord) -> None:
        log.warning("%s is dead: %s", record.describe(), record.death)
        # A frozen worker's calls would hold their steps until the deadline (and a survivor's
        # receive until the data plane's): they end now, and the step's error names the dead one.
        self.dispatcher.abandon(record, WorkerUnavailable(f"declared dead ({record.death})"))
        self.values.table.drop_worker(record.worker_id)
        self.records.worker_died(record.worker_id)
        for job in self.jobs.on_worker(record):
            self.lost_worker(job, f"{record.describe()} died: {record.death}")

    def lost_worker(self, job: Job, cause: str) -> None:
        """One of the job's workers is gone, or no longer holds the job: an auto_resume job is
        restored before its next step, any other fails."""
        if job.auto_resume and job.state in (JobState.READY, JobState.LOADING, JobState.RECOVERING):
            job.broken = cause
            if job.state is JobState.RECOVERING:  # its next step restores it
                job.settle(JobState.READY)
        else:
            self.fail(job, cause)

    def unload(self, job: Job, wait: bool) -> None:
        """Unload the job from its live workers (waiting for their answers, or not) and stop
        counting it in their load."""
        live = [w for w in job.workers if w.alive and not w.returning]  # a returning one drops it on return
        calls = [Call(w, "Unload", pb.JobRef(job_id=job.job_id)) for w in live]
        if wait:
            self.dispatcher.each(calls, 10.0)
        else:
            self.dispatcher.submit(calls, 10.0)
        self.rendezvous.close(job.namespace)
        with self.jobs.lock:
            for w in job.workers:
                w.jobs.discard(job.job_id)
            self.jobs.admission.released()

    def fail(self, job: Job, reason: str) -> None:
        """Fail the job and free what it holds on its workers at once (nothing can use it any
        more); its record and error stay for status until the client closes it."""
        if job.fail(reason):
            self.metrics.failed(job)
            self.records.job_state(job.job_id, JobState.FAILED.value, reason)
            self.unload(job, wait=False)

    def fail_loading(self, job: Job, reason: str) -> None:
        """A job that could not be loaded: failed, and unloaded from its workers before the client hears."""
        if job.fail(reason):
            self.metrics.failed(job)
            self.records.job_state(job.job_id, JobState.FAILED.value, reason)
        self.unload(job, wait=True)

    def step_failed(self, job: Job, seq: int, cause: str) -> JobFailed:
        """Fail the job for its step ``seq``; returns the error the client gets."""
        self.fail(job, f"step {seq} failed: {cause}")
        return JobFailed(f"job {job.job_id} step {seq} failed; the job must be submitted again. Cause: {cause}")

    def close_id(self, job_id: str) -> None:
        if self.jobs.is_closed(job_id):
            return  # closing twice is fine
        self.close(self.jobs.get(job_id))

    def close(self, job: Job) -> None:
        if job.state is not JobState.FAILED:  # a failed job was unloaded when it failed
            self.unload(job, wait=True)
        job.state = JobState.CLOSED
        held = self.jobs.remove(job)
        heap.release(job.job_id)
        self.gate.forget(job.job_id)
        self.metrics.forget(job)
        if job.session and job.session not in held:
            self.leases.forget(job.session)

    def run_lease_checks(self, stopped: threading.Event) -> None:
        """Close, in the background until ``stopped``, every job whose client session's lease has run out."""

        def loop():
            while not stopped.wait(min(1.0, self.leases.timeout_s / 4)):
                for job in self.jobs.all():
                    ended = job.state in (JobState.READY, JobState.FAILED)
                    if job.session and ended and self.leases.expired(job.session):
                        log.warning("job %s: its client's lease ran out; closing it", job.job_id)
                        try:
                            self.close(job)
                        except Exception:  # noqa: BLE001 (the next sweep tries again)
                            log.exception("closing job %s failed", job.job_id)

        threading.Thread(target=loop, name="leases", daemon=True).start()
