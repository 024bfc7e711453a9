"""auto_resume: a job that outlives the death of its workers.

Such a job saves a checkpoint (atoll.core.checkpoint, written by its workers) as soon as it is
loaded and every ``checkpoint_every`` training steps after, and keeps a journal of the training
steps since the last one: their requests and losses. When one of its workers dies (its heartbeat
stops, or a step fails and the worker no longer answers), the job is restored before its next step
goes out, or before the failed step is tried again:

1. it is unloaded from its surviving workers (which drops their part of the broken data plane);
2. it is placed again on live workers, least loaded first, so a spare worker takes the dead one's
   place (the surviving ones are usually chosen again);
3. its plan is loaded there, in a fresh data-plane namespace, with the checkpoint's state;
4. the journal is replayed, step by step, each loss compared with the one first reported.

The client sees a slow step, not an error: ``step`` raises only when no restore succeeds within
``MAX_RESTORES`` attempts (no live workers to place on, an unreadable checkpoint, a restore that
fails again). Steps of such a job run one at a time, the job's order held through each, so a
failed step is repaired before the next one goes out: the price is the overlap of asynchronous
dispatch. Replay is exact because a step is a pure function of the state and the batch here
(no random number generator is carried between steps; dropout would need one per step).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import ClassVar

from atoll._rpc import atoll_pb2 as pb
from atoll.controller.cluster.dispatch import DispatchError
from atoll.controller.cluster.metrics import ControllerMetrics
from atoll.controller.gang import Gang
from atoll.controller.jobs import Job, JobState
from atoll.controller.lifecycle import Lifecycle
from atoll.controller.loading import Loader
from atoll.controller.state import StateStore
from atoll.controller.statedir import MemoryState
from atoll.errors import InvalidInput, JobFailed, NotEnoughWorkers

log = logging.getLogger("atoll.controller")


@dataclass(kw_only=True, eq=False)
class AutoResume:
    """Runs the steps of auto_resume jobs and restores them: it places them again (``lifecycle``),
    loads them (``loader``) from their checkpoints (``state``), and runs and blames steps (``gang``)."""

    lifecycle: Lifecycle
    loader: Loader
    state: StateStore
    gang: Gang
    metrics: ControllerMetrics
    records: MemoryState
    """The state directory: the journal is kept there too, for a restarted controller."""

    MAX_RESTORES: ClassVar[int] = 3
    """Restores tried for one step before the job fails."""

    def step(self, job: Job, seq: int, request: pb.StepRequest, mode: str) -> pb.StepReply:
        """Run step ``seq`` of an auto_resume job, holding ``job.order``: restore the job first if
        it is broken, and again whenever a worker dies under the step or the checkpoint after it."""
        reply = self._journaled(job, seq)
        every = job.compiled.request.config.checkpoint_every
        for _ in range(self.MAX_RESTORES + 1):
            try:
                if job.broken:
                    self._restore(job)
                if reply is None:
                    started = time.perf_counter()
                    replies = self.gang.run_step(job, seq, request, mode)
                    reply = self.gang.step_reply(job, seq, replies)
                    job.count(seq, mode)
                    if mode == "train":
                        job.journal.append((seq, request, reply.loss))
                        self.records.journal_append(job.job_id, seq, request, reply.loss)
                    job.stepped(mode, reply.loss, replies)
                    self.metrics.step(job, mode, time.perf_counter() - started, replies)
                if job.journal and job.steps % every == 0:
                    self.state.checkpoint(job)
                return reply
            except DispatchError as e:
                cause = self.gang.blame(job, e)
                if all(w.alive for w in job.workers):  # no worker lost: the step itself is at fault
                    raise self.lifecycle.step_failed(job, seq, cause) from None
                job.broken = cause
            except (NotEnoughWorkers, InvalidInput) as e:
                self.lifecycle.fail(job, f"auto_resume could not restore the job: {e}")
                raise JobFailed(f"job {job.job_id}: {job.error}") from None
        self.lifecycle.fail(job, f"auto_resume gave up after {self.MAX_RESTORES} restores; last cause: {job.broken}")
        raise JobFailed(f"job {job.job_id}: {job.error}")

    @staticmethod
    def _journaled(job: Job, seq: int) -> pb.StepReply | None:
        """A step sent again after a controller restart that the journal holds already: its loss
        from there (a restore replays it; running it again would train on its batch twice)."""
        for number, _, loss in job.journal:
            if number == seq:
                return pb.StepReply(loss=loss, step=seq)
        return None

    def _restore(self, job: Job) -> None:
        """Steps 1-4 of the module's docstring; raises DispatchError if a worker fails meanwhile."""
        started, cause = time.monotonic(), job.broken
        job.broken = ""  # a worker dying from here on breaks the job again
        log.warning("job %s: restoring it from its checkpoint (%s)", job.job_id, cause)
        lost = [w.worker_id for w in job.workers if not w.alive]
        self.lifecycle.unload(job, wait=True)
        self.lifecycle.place_again(job)
        self.loader.load(job, job.compiled.request.config.checkpoint_path)
        job.state = JobState.READY
        drift = 0.0  # the largest relative difference between a replayed loss and the first one
        for seq, request, loss in job.journal:
            reply = self.gang.step_reply(job, seq, self.gang.run_step(job, seq, request, "train"))
            job.steps += 1
            drift = max(drift, abs(reply.loss - loss) / max(abs(loss), 1e-12))
        record = {
            "cause": cause,
            "lost": lost,
            "workers": [w.worker_id for w in job.workers],
            "from_step": job.report["resumed_from"]["step"],
            "replayed_steps": len(job.journal),
            "replay_loss_drift": drift,
            "seconds": round(time.monotonic() - started, 3),
        }
        job.report.setdefault("restores", []).append(record)
        log.warning("job %s: restored on %s in %.2f s", job.job_id, ", ".join(record["workers"]), record["seconds"])
