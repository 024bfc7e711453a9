"""A client's step, from its arrival to its reply: its turn in the client's numbering, the checks
of its batch against the job's specs, its dispatch, and what its end does to the job."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import ClassVar

from atoll._rpc import atoll_pb2 as pb
from atoll.controller.cluster.dispatch import DispatchError
from atoll.controller.cluster.metrics import ControllerMetrics
from atoll.controller.gang import Gang
from atoll.controller.jobs import Job, JobTable
from atoll.controller.lifecycle import Lifecycle
from atoll.controller.resume import AutoResume
from atoll.controller.values import ValueTable
from atoll.core.names import STEP_MODES
from atoll.core.wire import EdgeSpec, interleave, spec_of_pb_tensor, tensor_spec_from_pb
from atoll.errors import InvalidInput

log = logging.getLogger("atoll.controller")


def check_batch(spec: EdgeSpec, tensors, refs=(), refs_at=(), direct=False) -> None:
    """The step's tensors and remote values (at positions ``refs_at``) fit the edge's spec;
    ``direct``: the tensors are specs only, their rows posted to the workers by the client."""
    remote = [tensor_spec_from_pb(r.spec, f"edge '{spec.name}'") for r in refs]
    sent = [spec_of_pb_tensor(t) for t in tensors]
    got = interleave(sent, remote, refs_at)
    if tuple(got) != spec.tensors:
        shown = ", ".join(map(str, got)) or "nothing"
        which = "the remote values are" if refs and not tensors else "received"
        raise InvalidInput(f"edge '{spec.name}': expected {spec}, {which} {shown}")
    for t, s in zip(tensors, sent):
        if direct and t.data:
            raise InvalidInput(f"edge '{spec.name}': a step whose batch was posted to the workers carries no bytes")
        if not direct and len(t.data) != s.nbytes:
            raise InvalidInput(f"edge '{spec.name}': {s} needs {s.nbytes} bytes, message carries {len(t.data)}")


def check_step(job: Job, request: pb.StepRequest) -> str:
    """The step's mode, once its batch matches the job's specs; raises InvalidInput otherwise."""
    topo = job.compiled.topology
    mode = request.mode or "train"
    if mode not in STEP_MODES:
        raise InvalidInput(f"unknown step mode {mode!r} (known: {', '.join(STEP_MODES)})")
    input_refs, target_refs = request.input_refs, request.target_refs  # their holders: at dispatch
    if request.direct and (input_refs or target_refs or job.auto_resume):
        # auto_resume runs a step again on other workers after a failure: it needs the batch itself
        why = "an auto_resume job" if job.auto_resume else "a step with remote values"
        raise InvalidInput(f"{why} takes its batch through the controller, not posted to the workers")
    check_batch(job.compiled.request.input, request.inputs, input_refs, request.input_ref_at, request.direct)
    if mode == "forward":
        if request.targets or target_refs:
            raise InvalidInput("a forward step takes no target")
    else:
        check_batch(job.compiled.request.target, request.targets, target_refs, request.target_ref_at, request.direct)
    if request.keep_outputs and mode != "forward":
        raise InvalidInput("only a forward step keeps its output on the workers")
    if topo.workers > topo.ranks and request.keep_outputs:
        raise InvalidInput("a data- or tensor-parallel job returns tensors, not remote values (not built yet)")
    return mode


def _check_in_batch(job: Job, request: pb.StepRequest, seq: int) -> str:
    """check_step for a step sent with others (Stepper.steps): numbered in turn, its output kept nowhere."""
    if request.seq and request.seq != seq:
        raise InvalidInput(f"the steps of one call are consecutive: step {request.seq} came where {seq} was due")
    mode = check_step(job, request)
    if mode == "forward":
        raise InvalidInput("steps sent together are train or evaluate steps; send forward steps one by one")
    return mode


def _named(request: pb.StepRequest) -> list[str]:
    """The remote values a step reads."""
    return [r.value_id for r in (*request.input_refs, *request.target_refs)]


@dataclass(kw_only=True, eq=False)
class Stepper:
    STEP_ORDER_TIMEOUT_S: ClassVar[float] = 30.0
    """How long a step waits for the steps numbered before it to arrive (``await_turn``)."""

    jobs: JobTable
    gang: Gang
    """Sends the step in gang order, fans its batch out and its replies in, and blames a failure."""
    lifecycle: Lifecycle
    """Fails the job whose step failed."""
    resume: AutoResume
    """Runs the steps of auto_resume jobs instead."""
    values: ValueTable
    """The remote values a step reads are held until it ends."""
    metrics: ControllerMetrics

    def step(self, request: pb.StepRequest) -> pb.StepReply:
        reads: list[str] = []  # the remote values the step reads, once acquired
        try:
            return self._step(request, reads)
        finally:
            self.values.release(reads)

    def _step(self, request: pb.StepRequest, reads: list[str]) -> pb.StepReply:
        job = self.jobs.ready(request.job_id)
        with job.order:  # steps go out in the client's order, each as soon as its turn comes
            seq = request.seq or job.next_seq
            # sent again after a controller restart, and numbered before the workers' slowest step:
            # every worker answers it from its ledger (atoll.worker.ledger), in any order
            again = request.retry and seq < job.next_seq
            if not again:
                self.await_turn(job, seq)
            started = time.perf_counter()
            try:  # a refused step still uses up its number, so the steps behind it do not wait
                job = self.jobs.ready(request.job_id)  # a worker may have died while this step waited
                mode = check_step(job, request)
                named = _named(request)
                self.values.acquire(named)  # kept until the step ends: a free meanwhile waits for it
                reads += named
                if job.auto_resume:  # one step at a time, holding the order: a failure is repaired in place
                    return self.resume.step(job, seq, request, mode)
                pending = self.gang.send_step(job, seq, request, mode)
            finally:
                if not again:
                    job.next_seq = seq + 1
                    job.order.notify_all()
        replies = self._replies(job, seq, pending)  # outside the order: the next step can go out meanwhile
        # a step sent again was counted when it first ended, or by a restarted controller's recovery
        return self._ended(job, seq, mode, replies, time.perf_counter() - started, count=not again)

    def steps(self, request: pb.StepsRequest) -> pb.StepsReply:
        """Consecutive steps of one job in one call (Job.steps_async): all are checked before any
        is sent (a bad one refuses the call and runs nothing), then each worker gets one RunSteps
        with its part of every step, in one gang position. A job that sends steps another way
        (auto_resume; relayed or sequential dispatch), or sends them again after a controller
        restart, runs them one by one, as separate steps."""
        steps = list(request.steps)
        if not steps or any(s.job_id != steps[0].job_id for s in steps):
            raise InvalidInput("Steps takes one or more steps, all of one job")
        job = self.jobs.ready(steps[0].job_id)
        if job.auto_resume or job.dispatch_mode != "direct" or any(s.retry for s in steps):
            for s in steps:
                _check_in_batch(job, s, s.seq)
            return pb.StepsReply(replies=[self.step(s) for s in steps])
        reads: list[str] = []  # the remote values the steps read, once acquired: held until they end
        try:
            return self._steps(job, steps, reads)
        finally:
            self.values.release(reads)

    def _steps(self, job: Job, steps: list[pb.StepRequest], reads: list[str]) -> pb.StepsReply:
        with job.order:
            first = steps[0].seq or job.next_seq
            self.await_turn(job, first)
            started = time.perf_counter()
            try:  # refused steps use up their numbers, as a single step's does
                job = self.jobs.ready(job.job_id)
                modes = [_check_in_batch(job, s, seq) for seq, s in enumerate(steps, start=first)]
                named = [value for s in steps for value in _named(s)]
                self.values.acquire(named)
                reads += named
                pending = self.gang.send_steps(job, first, steps, modes)
            finally:
                job.next_seq = first + len(steps)
                job.order.notify_all()
        replies = self._replies(job, first, pending)
        seconds = (time.perf_counter() - started) / len(steps)
        return pb.StepsReply(
            replies=[
                self._ended(job, first + i, mode, [r.replies[i] for r in replies], seconds)
                for i, mode in enumerate(modes)
            ]
        )

    def _replies(self, job: Job, seq: int, pending) -> list:
        """The workers' replies to what went out as step ``seq``; a failure fails the job."""
        try:
            return pending.replies()
        except DispatchError as e:
            cause = self.gang.blame(job, e)
            raise self.lifecycle.step_failed(job, seq, cause) from None
        finally:
            self.gang.leave(job)

    def _ended(self, job: Job, seq: int, mode: str, replies: list, seconds: float, count=True) -> pb.StepReply:
        """Step ``seq`` ended well: count it (unless not ``count``), keep its loss for status, and
        build its reply."""
        if mode == "train" and count:  # status counts training steps
            with job.order:
                job.count(seq, mode)
        reply = self.gang.step_reply(job, seq, replies)
        job.stepped(mode, reply.loss, replies)
        self.metrics.step(job, mode, seconds, replies)
        return reply

    def await_turn(self, job: Job, seq: int) -> None:
        """Wait (holding ``job.order``) until step ``seq`` is the next to go out. A step number
        that never arrives (lost with its client) is skipped after a deadline, as workers skip
        missing gang positions, so one lost request cannot stall the job."""
        if seq < job.next_seq:
            raise InvalidInput(
                f"job {job.job_id}: step number {seq} is already used ({job.next_seq - 1} steps have gone out); "
                f"another client may be stepping this job, or the step was sent twice or skipped as missing"
            )
        deadline = time.monotonic() + self.STEP_ORDER_TIMEOUT_S
        while job.next_seq != seq:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning("job %s: steps %d..%d never arrived; skipping them", job.job_id, job.next_seq, seq - 1)
                job.next_seq = seq
                break
            job.order.wait(remaining)
