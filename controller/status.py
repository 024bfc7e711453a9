"""What the controller reports: the cluster's status (queue, workers, jobs), a job's plan, and a
job's measured timelines beside the predicted one."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from atoll._rpc import atoll_pb2 as pb
from atoll.controller.cluster.dispatch import Call, Dispatcher
from atoll.controller.cluster.registry import Registry
from atoll.controller.compiler import trace
from atoll.controller.jobs import JobState, JobTable
from atoll.core.spans import KEPT_STEPS
from atoll.errors import InvalidInput, JobFailed


def _same(record, *names: str) -> dict:
    """The fields a reply message shares with ``record``, under the same names."""
    return {name: getattr(record, name) for name in names}


@dataclass(kw_only=True, eq=False)
class Reports:
    jobs: JobTable
    registry: Registry
    dispatcher: Dispatcher
    """Asks the workers for their timelines."""
    status_grace_s: float
    """How long a dead worker or a failed job still shows in Status (without ``all``)."""

    def status(self, request: pb.StatusRequest) -> pb.StatusReply:
        now = time.monotonic()
        jobs, queue = self.jobs.snapshot()
        shown = lambda ended_at: request.all or not ended_at or now - ended_at <= self.status_grace_s  # noqa: E731
        workers = [w for w in self.registry.all() if w.alive or shown(w.died_at)]
        jobs = [j for j in jobs if j.state is not JobState.FAILED or shown(j.failed_at)]
        return pb.StatusReply(
            queue=[
                pb.QueuedRequest(**_same(t, "name", "ranks", "device", "islands", "exclusive"), waited_s=now - t.since)
                for t in queue
            ],
            workers=[
                pb.WorkerInfo(
                    **_same(w, "worker_id", "address", "device", "host", "pid", "island", "rss_bytes", "returning"),
                    running_steps=w.running_steps,
                    alive=w.alive and not w.returning,
                    seconds_since_heartbeat=now - w.last_heartbeat,
                    jobs=sorted(w.jobs),
                )
                for w in workers
            ],
            jobs=[
                pb.JobInfo(
                    **_same(
                        j,
                        "job_id",
                        "name",
                        "steps",
                        "error",
                        "exclusive",
                        "predicted_peak_bytes",
                        "measured_peak_bytes",
                    ),
                    state=j.state.value,
                    workers=[w.worker_id for w in j.workers],
                    schedule=j.compiled.topology.schedule,
                    stages=j.compiled.topology.ranks,
                    steps_per_s=j.steps / max(now - j.loaded_at, 1e-9),
                    has_loss=j.last_loss is not None,
                    last_loss=j.last_loss or 0.0,
                    base_name=j.compiled.request.config.base_name,
                    base=j.compiled.request.config.base,
                )
                for j in jobs
            ],
        )

    def plan(self, job_id: str) -> pb.PlanReply:
        job = self.jobs.get(job_id)
        with job.order:
            return pb.PlanReply(plan_json=json.dumps(job.report), next_step=job.next_seq)

    def timeline(self, request: pb.TimelineRequest) -> pb.TimelineReply:
        """The job's measured timelines of the asked steps beside the predicted one (controller/compiler/trace.py)."""
        job = self.jobs.ready(request.job_id)
        if request.last < 0 or len(request.steps) > KEPT_STEPS:
            raise InvalidInput(f"ask for at most {KEPT_STEPS} steps (workers keep the last {KEPT_STEPS})")
        ask = pb.TimelineRequest(job_id=job.job_id, steps=request.steps, last=request.last)
        replies = self.dispatcher.each([Call(w, "GetTimeline", ask) for w in job.workers], 30.0)
        gathered = []
        for i, (w, reply) in enumerate(zip(job.workers, replies)):
            if isinstance(reply, Exception):
                raise JobFailed(f"timeline of job {job.job_id}: {w.describe()}: {reply}")
            rank = job.compiled.topology.coordinates(i)[1]
            gathered.append(
                trace.WorkerSteps(
                    i,
                    f"worker {i} (rank {rank}) {w.worker_id}",
                    reply.steps,
                    worker_id=w.worker_id,
                    host=w.host,
                    device=w.device,
                    cpus=list(reply.cpus),
                    threads=reply.compute_threads,
                )  # fmt: skip
            )
        events, summary = trace.build(job.compiled, gathered)
        return pb.TimelineReply(trace_json=json.dumps(events), summary_json=json.dumps(summary))
