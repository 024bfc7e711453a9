"""Sending a job's ordered work to its workers in gang order: a step's batch fanned out to the
workers that read it, their replies fanned back in to one StepReply, and the blame when one fails."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import ClassVar

import grpc

from atoll._rpc import atoll_pb2 as pb
from atoll.controller.cluster.dispatch import Call, Dispatcher, DispatchError
from atoll.controller.cluster.fairness import FairGate
from atoll.controller.cluster.registry import Registry
from atoll.controller.jobs import GangScheduler, Job
from atoll.controller.remote import RemoteValues
from atoll.core.wire import join_rows, join_slices, shard_rows
from atoll.errors import AtollError


def _batch_readers(job: Job):
    """Each worker that reads the job's batch, replica by replica: (worker index, replica, whether it
    reads the inputs, whether it reads the targets); every other worker reads none of it."""
    topo = job.compiled.topology
    readers, last = job.compiled.batch_ranks, topo.rank_of(topo.num_stages - 1)
    for d, r, tp in itertools.product(range(topo.data_parallel), sorted({*readers, last}), range(topo.tensor_parallel)):
        yield topo.worker(d, r, tp), d, r in readers, r == last


def _step_requests(job: Job, seq: int, request: pb.StepRequest, mode: str, input_refs, target_refs):
    """Step ``seq``'s request per worker index (only for the workers that read the batch or hold
    the last stage), and the request shared by all the others."""
    own = {
        index: _fill(pb.RunStepRequest(), job, seq, request, mode, read, input_refs, target_refs)
        for index, read in _reads(job, request).items()
    }
    return own, _fill(pb.RunStepRequest(), job, seq, request, mode)


def _reads(job: Job, request: pb.StepRequest) -> dict:
    """Per worker index that reads the batch or holds the last stage: its replica's rows of the
    inputs and of the targets, whether it reads the inputs, whether it reads the targets, and its
    replica (the rows it keeps of a remote value)."""
    replicas = job.compiled.topology.data_parallel
    reads, rows = {}, {}
    for index, d, inputs, targets in _batch_readers(job):
        if d not in rows:  # each replica reads its own rows of the batch, cut once
            rows[d] = (
                [shard_rows(t, d, replicas) for t in request.inputs],
                [shard_rows(t, d, replicas) for t in request.targets],
            )
        reads[index] = (*rows[d], inputs, targets, d)
    return reads


def _fill(
    step: pb.RunStepRequest,
    job: Job,
    seq: int,
    request: pb.StepRequest,
    mode: str,
    read=None,
    input_refs=(),
    target_refs=(),
) -> pb.RunStepRequest:
    """Write step ``seq`` into a worker's ``step``: with ``read`` (from ``_reads``), the part of
    the batch it reads. Each tensor is copied in by ``CopyFrom``, and a call's steps are written
    into it (``_steps_calls``): protobuf merges a message handed to a constructor by serializing
    and parsing it, the bytes copied twice, and a step built first was then copied again into its
    call. Parsing a 4-step call of 1 MiB batches and building and serializing both workers' calls
    took 1.7 ms so, against 3.3 with constructors and 2.3 with ``extend``."""
    step.job_id, step.step, step.mode = job.job_id, seq, mode
    if read is None:
        return step
    inputs, targets, reads_inputs, reads_targets, replica = read
    replicas = job.compiled.topology.data_parallel
    if replicas > 1 and ((reads_inputs and input_refs) or (reads_targets and target_refs)):
        step.ref_replica, step.ref_replicas = replica, replicas  # it keeps its rows of what it pulls
    if reads_inputs:
        for tensor in inputs:
            step.inputs.add().CopyFrom(tensor)
        step.input_refs.extend(input_refs)
        step.input_ref_at.extend(request.input_ref_at)
    if reads_targets:
        for tensor in targets:
            step.targets.add().CopyFrom(tensor)
        step.target_refs.extend(target_refs)
        step.target_ref_at.extend(request.target_ref_at)
        step.keep_outputs = request.keep_outputs
    step.direct = request.direct
    return step


def _steps_calls(
    job: Job, first: int, requests: list[pb.StepRequest], modes: list[str], refs
) -> list[pb.RunStepsRequest]:
    """Each worker's RunSteps for steps ``first``, ``first + 1``, ...: every step written into
    its call in place (see ``_fill``); ``refs``: each step's remote inputs and targets, with
    their holders' addresses."""
    calls = [pb.RunStepsRequest() for _ in job.workers]
    for seq, (request, mode, (input_refs, target_refs)) in enumerate(zip(requests, modes, refs), start=first):
        reads = _reads(job, request)
        for index, call in enumerate(calls):
            _fill(call.steps.add(), job, seq, request, mode, reads.get(index), input_refs, target_refs)
    return calls


def batch_route(job: Job) -> pb.BatchRouteReply:
    """The workers that read the job's batch and which part each reads (as ``_step_requests``
    cuts it), for a client that posts batches to them itself."""
    replicas = job.compiled.topology.data_parallel
    route = pb.BatchRouteReply()
    for index, d, inputs, targets in _batch_readers(job):
        worker = job.workers[index]
        route.readers.append(
            pb.BatchReader(
                worker_id=worker.worker_id,
                address=worker.address,
                replica=d,
                replicas=replicas,
                inputs=inputs,
                targets=targets,
            )
        )
    return route


@dataclass(kw_only=True, eq=False)
class Gang:
    dispatcher: Dispatcher
    registry: Registry
    """Blame marks the workers that no longer answer dead."""
    gate: FairGate
    """A step enters it before its positions are taken (controller/cluster/fairness.py)."""
    values: RemoteValues
    """A step's remote values are sent with their holders' addresses; the outputs it keeps become values."""
    step_timeout_s: float
    order: GangScheduler = field(default_factory=GangScheduler, init=False)

    PROBE_TIMEOUT_S: ClassVar[float] = 2.0

    def dispatch(self, calls: list[Call], timeout_s: float, mode: str = "direct", common=None, lane: str = ""):
        """Give each call its worker's next gang position and send them all, without waiting:
        ``mode`` "direct", "relay" (a step through relaying workers; ``common`` is the request
        shared by the ranks that have none of their own) or "sequential" (JobConfig.dispatch).
        ``lane``: the job's own order (``Job.lane``), which workers keep as they do (a plan's
        LoadPlan always takes the workers' common order)."""
        with self.order.positions() as take:
            take(calls, lane)
            if mode == "direct":
                pending = self.dispatcher.submit(calls, timeout_s)
            elif mode == "relay":
                pending = self.dispatcher.relay(calls, common, timeout_s)
        if mode == "sequential":
            pending = self.dispatcher.sequential(calls, timeout_s)
        pending.on_end(self.order.ended)
        return pending

    def send_step(self, job: Job, seq: int, request: pb.StepRequest, mode: str):
        """Send step ``seq`` to every worker of the job, in gang order; the caller waits for the
        replies and then calls ``leave(job)``."""
        own, common = _step_requests(job, seq, request, mode, *self._holders(request))
        calls = [Call(w, "RunStep", own.get(i, common)) for i, w in enumerate(job.workers)]
        return self._through_gate(job, calls, 1, job.dispatch_mode, common)

    def send_steps(self, job: Job, first: int, requests: list[pb.StepRequest], modes: list[str]):
        """Send steps ``first``, ``first + 1``, ... (none keeps its output) as one RunSteps per
        worker, in one gang position each; the replies are RunStepsReply, in worker order."""
        refs = [self._holders(r) for r in requests]
        calls = [Call(w, "RunSteps", c) for w, c in zip(job.workers, _steps_calls(job, first, requests, modes, refs))]
        return self._through_gate(job, calls, len(requests))

    def _holders(self, request: pb.StepRequest) -> tuple[list, list]:
        """A step's remote inputs and targets with their holders' current addresses."""
        return self.values.resolve(request.input_refs), self.values.resolve(request.target_refs)

    def _through_gate(self, job: Job, calls: list[Call], steps: int, mode: str = "direct", common=None):
        """Dispatch ``calls`` (``steps`` of the job's steps) once the fair gate lets them go: fair
        between jobs sharing workers (controller/cluster/fairness.py), then in gang order. A
        dispatch that fails leaves the gate at once."""
        # a job in a lane of its own waits for no other job's steps: they run beside its own
        shared = frozenset({f"lane {job.lane}"}) if job.lane else job.worker_ids
        self.gate.enter(job.job_id, shared, job.weight, steps)
        try:
            return self.dispatch(calls, self.step_timeout_s * steps, mode, common, job.lane)
        except BaseException:
            self.leave(job)
            raise

    def leave(self, job: Job) -> None:
        """A step sent by ``send_step`` has ended: the next one of another job may enter the gate."""
        self.gate.leave(job.job_id)

    def run_step(self, job: Job, seq: int, request: pb.StepRequest, mode: str) -> list:
        """Send step ``seq`` and wait for its replies (in worker order)."""
        pending = self.send_step(job, seq, request, mode)
        try:
            return pending.replies()
        finally:
            self.leave(job)

    def step_reply(self, job: Job, seq: int, replies: list) -> pb.StepReply:
        """The client's reply to step ``seq``, from its workers' replies."""
        topo = job.compiled.topology
        last = topo.rank_of(topo.num_stages - 1)
        lasts = [replies[topo.worker(d, last)] for d in range(topo.data_parallel)]
        losses = [loss for reply in lasts for loss in reply.microbatch_losses]  # replica by replica
        outputs = [reply.outputs for reply in lasts]
        if job.compiled.output_dims and lasts[0].outputs:  # each island rank holds a slice of the logits
            dims = job.compiled.output_dims
            outputs = [
                join_slices([replies[topo.worker(d, last, tp)].outputs for tp in range(topo.tensor_parallel)], dims)
                for d in range(topo.data_parallel)
            ]
        # each worker's accounting is JSON already: joined, not parsed (a job may have many workers)
        memory = ", ".join(f'"{r}": {rep.memory_json or "{}"}' for r, rep in enumerate(replies))
        return pb.StepReply(
            loss=sum(losses) / len(losses) if losses else 0.0,
            microbatch_losses=losses,
            step=seq,
            memory_json="{" + memory + "}",
            outputs=join_rows(outputs),
            kept_outputs=[self.values.kept(job.workers[last], k) for k in replies[last].kept_outputs],
        )

    def blame(self, job: Job, error: DispatchError) -> str:
        """Name the cause of a failed step. When a worker dies, its peers' data-plane receives
        often fail before the controller hears anything from (or about) the dead one, so the
        first error to arrive is a survivor's. Ping every worker of the job: the unreachable
        ones are marked dead and named first, so the caller learns which worker to look at."""
        if error.code == grpc.StatusCode.UNAVAILABLE:
            self.registry.mark_dead(error.worker, f"unreachable during a step: {error.error}")
        # one already declared dead (its calls abandoned, the job unloaded from the rest, which
        # ends their waits on it): the survivors' errors that follow are its consequence
        gone = [w for w in job.workers if not w.alive and w is not error.worker]
        if gone:
            named = ", ".join(f"{w.describe()} declared dead ({w.death})" for w in gone)
            return f"{named}; a peer reported: {error}"
        calls = [Call(w, "Ping", pb.Empty()) for w in job.workers if w is not error.worker and w.alive]
        dead = []
        for call, reply in zip(calls, self.dispatcher.each(calls, self.PROBE_TIMEOUT_S)):
            if isinstance(reply, AtollError) and reply.code in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ):
                self.registry.mark_dead(call.worker, f"unreachable after a failed step: {reply}")
                dead.append(call.worker)
        if not dead:
            now = time.monotonic()  # a frozen or cut-off worker: alive for now, but silent
            silent = [
                w for w in job.workers if w.alive and now - w.last_heartbeat > 2 * self.registry.heartbeat_interval_s
            ]
            if silent:
                named = ", ".join(f"{w.describe()} (no heartbeat for {now - w.last_heartbeat:.1f}s)" for w in silent)
                return f"{named}; a peer reported: {error}"
            return str(error)
        named = ", ".join(w.describe() for w in dead)
        return f"{named} unreachable (did the worker die?); a peer reported: {error}"
