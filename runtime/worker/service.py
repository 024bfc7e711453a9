"""The Worker gRPC service: the RPCs the controller (and peers, for values) call on a worker.

Thin by design: each RPC takes its turn in the gang order (``Turnstile``) and hands the work to
the job's executor, the plan loader (atoll.worker.loader) or the value store.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import uuid
from pathlib import Path

import torch

from atoll._rpc import atoll_pb2 as pb
from atoll._rpc import atoll_pb2_grpc as pb_grpc
from atoll.core import checkpoint
from atoll.core.shards import ParamShard
from atoll.core.wire import tensor_from_pb, tensor_spec_to_pb, tensor_to_pb
from atoll.errors import InvalidInput, JobFailed, NotFound, NotPermitted
from atoll.net import log as _log
from atoll.net.auth import from_controller
from atoll.net.relay import Relay
from atoll.net.rpc import Endpoint, chunked_method, rpc_handler, rpc_stream_handler
from atoll.worker import step_batch
from atoll.worker.channel import StepChannels
from atoll.worker.executor.interpreter import PipelineExecutor
from atoll.worker.inbox import BatchInbox, PostedBatch, check_reader
from atoll.worker.interleave import Interleaver
from atoll.worker.ledger import StepLedger
from atoll.worker.loader import PlanLoader
from atoll.worker.turnstile import Turnstile
from atoll.worker.values import ValueStore, pull

# One logger for the whole worker (as the controller has "atoll.controller"): operators filter
# the worker's lines by this name, which predates the split into daemon, service and loader.
log = logging.getLogger("atoll.worker.daemon")


def controller_only(method):
    """Work (plans, steps, state, values) comes only from the controller this worker registered
    with: its calls carry the key it gave at registration. Another holder of the cluster token
    (a client, a fuzzer) gets PERMISSION_DENIED, and the worker's gang order is untouched."""

    @functools.wraps(method)
    def wrapped(self, request, context):
        if not from_controller(context, self.controller_key):
            raise NotPermitted(f"{method.__name__}: only the controller this worker registered with may call it")
        return method(self, request, context)

    return wrapped


class WorkerService(pb_grpc.WorkerServicer):
    def __init__(self, *, device: str, host: str, token: str, bind_host: str | None = None):
        self.device = torch.device(device)
        self.host = host
        """The address peers reach this worker at (data plane)."""
        self._token = token
        self.values = ValueStore(bind_host or host, token, advertise_host=host)
        self._jobs: dict[str, PipelineExecutor] = {}
        self._ledgers: dict[str, StepLedger] = {}
        """Per loaded job, its steps here: a step sent twice runs once (atoll.worker.ledger)."""
        self._stepping: dict[str, int] = {}
        """Per job whose step runs now, that call's gang position (``Unload`` releases it)."""
        self.running_steps = 0
        """Step calls running now, released ones included (reported with each heartbeat)."""
        self._lock = threading.Lock()
        self.turnstile = Turnstile()
        """The order of the island's work (LoadPlan, and every call of a job without a lane)."""
        self._lanes: dict[str, Turnstile] = {}
        """Per job attached to a resident base: its own order (controller/jobs.py, Job.lane), kept after unloading."""
        self.inbox = BatchInbox()
        """Batches clients posted here for their steps (runtime/worker/inbox.py)."""
        self._interleaver = Interleaver()
        """Runs the steps of the jobs with lanes an action at a time, in one thread (runtime/worker/interleave.py)."""
        self.relay = Relay(token, self._step_in_turn)
        self.channels = StepChannels(self._step_in_turn)
        self.controller_key = ""
        """Set at registration: the key the controller's calls carry (``controller_only``)."""
        self.controller: Endpoint | None = None
        """The controller this worker registered with: the data plane's rendezvous is there."""

    def _job(self, job_id: str) -> PipelineExecutor:
        with self._lock:
            executor = self._jobs.get(job_id)
        if executor is None:
            raise NotFound(f"job {job_id!r} is not loaded on this worker")
        return executor

    def _order(self, job_id: str) -> Turnstile:
        """The turnstile a job's calls (but its LoadPlan) take their turns in."""
        with self._lock:
            return self._lanes.get(job_id, self.turnstile)

    def reset_order(self) -> None:
        """A new controller numbers every order from 1 again (see Turnstile.reset)."""
        with self._lock:
            turnstiles = [self.turnstile, *self._lanes.values()]
        for turnstile in turnstiles:
            turnstile.reset()

    def _ledger(self, job_id: str) -> StepLedger:
        self._job(job_id)  # the same error for a job that is not here
        with self._lock:
            return self._ledgers[job_id]

    def held_jobs(self) -> list[pb.HeldJob]:
        """The jobs loaded here and how far their steps got (sent when registering again)."""
        with self._lock:
            return [ledger.held(job_id) for job_id, ledger in self._ledgers.items()]

    def keep_only(self, job_ids: set[str]) -> None:
        """Forget every job but ``job_ids``: the controller does not know the others (it restarted
        without their records, or declared this worker dead), so nobody could close them."""
        with self._lock:
            dropped = {j: self._jobs.pop(j) for j in list(self._jobs) if j not in job_ids}
            self._ledgers = {j: ledger for j, ledger in self._ledgers.items() if j in job_ids}
        for job_id, executor in dropped.items():
            self.inbox.drop(job_id)
            executor.close()

    @rpc_handler
    @controller_only
    def LoadPlan(self, request: pb.LoadPlanRequest, context):
        with self.turnstile.turn(request.gang_seq, request.gang_floor):
            return self._load(request)

    def _use_device(self) -> None:
        if self.device.type == "cuda":  # gRPC runs each call on a pool thread; CUDA's device is per thread
            torch.cuda.set_device(self.device)

    @_log.in_context(lambda request: (request.job_id, None))
    def _load(self, request: pb.LoadPlanRequest) -> pb.LoadPlanReply:
        with self._lock:
            if request.job_id in self._jobs:
                raise InvalidInput(f"job {request.job_id!r} is already loaded on this worker")
            base = self._jobs.get(request.base_job) if request.base_job else None
        if request.base_job and base is None:
            raise InvalidInput(f"job {request.job_id}: its base job {request.base_job!r} is not loaded on this worker")
        self._use_device()
        executor = PlanLoader(device=self.device, host=self.host, controller=self.controller).load(request, base)
        with self._lock:
            self._jobs[request.job_id] = executor
            self._ledgers[request.job_id] = StepLedger(request.store_namespace)
            if base is not None:
                self._lanes[request.job_id] = Turnstile()
                if executor.interleavable:
                    executor.interleaver = self._interleaver
        log.info("loaded job %s as worker %d (%d actions)", request.job_id, request.mesh.worker, len(request.actions))
        return pb.LoadPlanReply(parameter_bytes=executor.parameter_bytes)

    def _step_in_turn(self, request: pb.RunStepRequest) -> pb.RunStepReply:
        with self._order(request.job_id).turn(request.gang_seq, request.gang_floor), self._stepping_at(request):
            return self._step_once(request)

    @contextlib.contextmanager
    def _stepping_at(self, request):
        """While the job's step runs, its gang position is known: unloading the job (it failed, a
        peer died) lets the order go on without waiting for a step stuck on that peer."""
        steps = [request] if isinstance(request, pb.RunStepRequest) else request.steps
        job_id = steps[0].job_id if steps else ""
        with self._lock:
            self._stepping[job_id] = request.gang_seq
            self.running_steps += 1
        try:
            yield
        finally:
            with self._lock:
                self.running_steps -= 1
                if self._stepping.get(job_id) == request.gang_seq:
                    del self._stepping[job_id]

    def _step_once(self, request: pb.RunStepRequest) -> pb.RunStepReply:
        """Run the step, unless it came before: then its earlier run's reply (atoll.worker.ledger)."""
        ledger, wait_s = self._ledger(request.job_id), self._earlier_wait_s(request.job_id)
        return ledger.run(request.step, request.mode or "train", lambda: self._step(request), wait_s)

    def _earlier_wait_s(self, job_id: str) -> float:
        """How long a step sent again waits for its earlier run: that run's data-plane deadline and more."""
        return 2 * self._job(job_id).timeout_s

    @rpc_handler
    @controller_only
    def RunStep(self, request: pb.RunStepRequest, context):
        return self._step_in_turn(request)

    @rpc_handler
    @controller_only
    def RunSteps(self, request: pb.RunStepsRequest, context):
        """Consecutive steps of one job in one turn, in order; the first failure fails the call."""
        job_id = request.steps[0].job_id if request.steps else ""
        # batches taken before the turn (atoll.worker.step_batch: one more copy of bytes the call holds
        # anyway), posted ones in it: taking one drops the job's earlier ones still waiting
        batches = [None if step.direct else self._batch(step) for step in request.steps]
        with self._order(job_id).turn(request.gang_seq, request.gang_floor), self._stepping_at(request):
            if not request.steps:
                return pb.RunStepsReply()
            ledger, wait_s = self._ledger(job_id), self._earlier_wait_s(job_id)
            earlier = [ledger.claim(step.step) for step in request.steps]  # all at once: a second sending waits
            replies = []
            for i, (step, before, batch) in enumerate(zip(request.steps, earlier, batches)):
                try:
                    if before is None:
                        run = functools.partial(self._step, step, batch)
                        replies.append(ledger.settle(step.step, step.mode or "train", run))
                    else:
                        replies.append(ledger.earlier(step.step, before, wait_s))
                except BaseException as e:
                    ledger.abandon([s.step for s, b in zip(request.steps[i + 1 :], earlier[i + 1 :]) if b is None], e)
                    raise
            return pb.RunStepsReply(replies=replies)

    @rpc_handler
    @controller_only
    def RunStepGroup(self, request: pb.RunStepGroupRequest, context):
        """This worker's part of a step, and the other members' relayed to them (runtime/net/relay.py)."""
        return self.relay.run(request)

    @rpc_stream_handler
    @controller_only
    def StepChannel(self, requests, context):
        """The controller's steps on one long-lived stream, each run as ``RunStep`` (worker/channel.py)."""
        yield from self.channels.serve(requests)

    @rpc_stream_handler
    @controller_only
    def RunStepStream(self, request: pb.RunStepRequest, context):
        """RunStep that first reports when its turn has come (sequential dispatch waits for it)."""
        with self._order(request.job_id).turn(request.gang_seq, request.gang_floor), self._stepping_at(request):
            yield pb.RunStepEvent(started=True)
            reply = self._step_once(request)
        yield pb.RunStepEvent(reply=reply)

    def _batch(self, request: pb.RunStepRequest) -> step_batch.StepBatch:
        """Step ``request``'s batch taken ahead of its turn (atoll.worker.step_batch), or why it
        cannot be had (its job unloaded meanwhile: the step's turn raises that)."""
        try:
            timeout_s = self._job(request.job_id).timeout_s
        except NotFound as e:
            return step_batch.StepBatch(error=e)
        return step_batch.take(request, timeout_s, self._pull, self.inbox, self.values.address)

    @_log.in_context(lambda request: (request.job_id, request.step))
    def _step(self, request: pb.RunStepRequest, batch: step_batch.StepBatch | None = None) -> pb.RunStepReply:
        """Run one step of a loaded job on its batch (by default taken now); call in the request's turn."""
        executor = self._job(request.job_id)
        batch = batch or step_batch.take(request, executor.timeout_s, self._pull, self.inbox, self.values.address)
        self._use_device()
        try:
            if batch.error is not None:
                raise batch.error
            losses, memory, outputs = executor.run_step(
                batch.inputs, batch.targets, request.mode or "train", request.step
            )
        except Exception as e:
            raise JobFailed(f"job {request.job_id} step {request.step}: {e}") from None
        memory["data_plane_bytes"]["received"] += batch.pulled_bytes
        memory["control_plane_tensor_bytes"] = batch.control_bytes
        memory["posted_batch_bytes"] = batch.posted_bytes
        kept = []
        if request.keep_outputs:  # the output stays here; the reply carries references
            for t in outputs:
                value_id = uuid.uuid4().hex
                spec = self.values.put(value_id, t)
                kept.append(pb.RemoteRef(value_id=value_id, spec=tensor_spec_to_pb(spec)))
            outputs = []
        return pb.RunStepReply(
            microbatch_losses=losses,
            memory_json=json.dumps(memory),
            outputs=[tensor_to_pb(t) for t in outputs],
            kept_outputs=kept,
        )

    def _pull(self, ref: pb.RemoteRef, timeout_s: float, rows: tuple[int, int] = (0, 1)) -> torch.Tensor:
        """A remote value (or its ``rows``), from this worker's store or straight from its holder."""
        if ref.address == self.values.address:
            return self.values.get(ref.value_id, rows)
        return pull(ref.address, self._token, ref.value_id, timeout_s, rows)

    @rpc_handler
    @controller_only
    def PutValue(self, request: pb.PutValueRequest, context):
        self.values.put(request.value_id, tensor_from_pb(request.tensor, "value"))
        return pb.Empty()

    @rpc_handler
    def GetValue(self, request: pb.RemoteRef, context):
        return tensor_to_pb(self.values.get(request.value_id))

    @rpc_handler
    def PostBatch(self, request: pb.PostBatchRequest, context):
        """A step's rows of the batch, straight from the client (any holder of the cluster token,
        who may step the job through the controller too); the step itself comes from the controller."""
        check_reader(self._job(request.job_id), request)
        inputs = [tensor_from_pb(t, "posted input") for t in request.inputs]
        targets = [tensor_from_pb(t, "posted target") for t in request.targets]
        self.inbox.post(request.job_id, request.step, PostedBatch(inputs, targets))
        return pb.Empty()

    @rpc_handler
    @controller_only
    def FreeValue(self, request: pb.RemoteRef, context):
        self.values.free(request.value_id)
        return pb.Empty()

    @rpc_handler
    @controller_only
    def GetState(self, request: pb.GetStateRequest, context):
        with self._order(request.job_id).turn(request.gang_seq, request.gang_floor):
            # serialized inside the turn: a queued step must not update weights mid-read
            state = self._job(request.job_id).state_dict()
            return pb.StateReply(tensors=[pb.NamedTensor(name=k, tensor=tensor_to_pb(v)) for k, v in state.items()])

    @rpc_handler
    @controller_only
    def SaveState(self, request: pb.SaveStateRequest, context):
        """Write this worker's tensors of the job into a checkpoint version (atoll.core.checkpoint);
        without a file (a ZeRO job's replica other than 0), only take part in gathering them."""
        with self._order(request.job_id).turn(request.gang_seq, request.gang_floor):
            tensors = self._job(request.job_id).checkpoint_tensors()
            if not request.file:
                return pb.SaveStateReply()
            if "/" in request.file or request.file.startswith("."):
                raise InvalidInput(f"checkpoint file name {request.file!r} must be a plain name")
            keys = checkpoint.write_tensors(Path(request.directory), request.file, tensors)
            return pb.SaveStateReply(
                tensors=[pb.SavedTensor(key=k, shape=shape, dtype=dtype) for k, (shape, dtype) in keys.items()]
            )

    @rpc_handler
    @controller_only
    def LoadState(self, request: pb.LoadStateRequest, context):
        """Load the job's weights and optimizer state from a committed checkpoint version, cut for
        this worker's place in the job's layout."""
        with self._order(request.job_id).turn(request.gang_seq, request.gang_floor):
            executor = self._job(request.job_id)
            version = Path(request.directory)
            try:
                manifest = json.loads((version / checkpoint.MANIFEST).read_text())
                cuts = {c.name: ParamShard.from_pb(c) for c in request.cuts}
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise InvalidInput(f"checkpoint {version}: {type(e).__name__}: {e}") from None
            reader = checkpoint.Reader(version, manifest)
            executor.restore(reader, cuts)
            return pb.Empty()

    @rpc_handler
    @controller_only
    def Unload(self, request: pb.JobRef, context):
        with self._lock:
            executor = self._jobs.pop(request.job_id, None)
            self._ledgers.pop(request.job_id, None)
            stuck = self._stepping.pop(request.job_id, 0)
            # the lane stays: a call of the job still on its way takes its turn there, not in the
            # common order (whose position it does not hold), and then finds the job gone
            order = self._lanes.get(request.job_id, self.turnstile)
        self.inbox.drop(request.job_id)
        if executor is None:
            raise NotFound(f"job {request.job_id!r} is not loaded on this worker")
        if order.release(stuck):
            log.warning(
                "job %s unloaded while its step (gang position %d) still waits; the order goes on",
                request.job_id,
                stuck,
            )
        executor.close()
        return pb.Empty()

    Chunked = chunked_method("Worker")

    @rpc_handler
    def Ping(self, request, context):
        return pb.Empty()

    @rpc_handler
    @controller_only
    def GetTimeline(self, request: pb.TimelineRequest, context):
        """The spans of the job's recent steps on this worker (atoll.core.spans); not ordered with
        steps, so it answers while a step runs."""
        executor = self._job(request.job_id)
        held = executor.history.select(list(request.steps), request.last)
        return pb.WorkerTimeline(
            steps=[s.to_pb(executor.rank) for s in held], cpus=_cpus(), compute_threads=torch.get_num_threads()
        )


def _cpus() -> list[int]:
    """The CPUs this process may run on: a timeline built on a host whose workers share too few
    of them is flagged (controller/compiler/trace.py)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return list(range(os.cpu_count() or 1))
