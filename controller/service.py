"""The Controller gRPC service: registry, compile + place + load, and step dispatch."""

from __future__ import annotations

import itertools
import json
import logging
import secrets
import threading
import time
import uuid

import grpc

from atoll._rpc import atoll_pb2 as pb
from atoll._rpc import atoll_pb2_grpc as pb_grpc
from atoll.controller.cluster.admission import AdmissionQueue, Ticket
from atoll.controller.cluster.dispatch import Call, Dispatcher, DispatchError
from atoll.controller.cluster.fairness import FairGate
from atoll.controller.cluster.leases import Leases
from atoll.controller.cluster.metrics import ControllerMetrics
from atoll.controller.cluster.placement import place
from atoll.controller.cluster.registry import Registry, WorkerRecord
from atoll.controller.cluster.rendezvous import Rendezvous
from atoll.controller.cluster.transports import GROUP_TRANSPORTS, edge_transports, peer_transports
from atoll.controller.compiler import trace
from atoll.controller.compiler.pipeline import CompiledPipeline, PipelineRequest, compile_pipeline
from atoll.controller.jobs import GangScheduler, Job, JobState
from atoll.controller.resume import AutoResume
from atoll.controller.values import ValueTable
from atoll.core import checkpoint
from atoll.core.actions import STEP_MODES
from atoll.core.config import JobConfig
from atoll.core.spans import KEPT_STEPS
from atoll.core.wire import (
    EdgeSpec,
    interleave,
    join_rows,
    join_slices,
    shard_rows,
    spec_from_pb,
    spec_of_pb_tensor,
    spec_to_pb,
    tensor_from_pb,
    tensor_spec_from_pb,
    tensor_spec_to_pb,
    tensor_to_pb,
)
from atoll.errors import AtollError, InvalidInput, JobFailed, NotEnoughWorkers, NotFound, NotPermitted
from atoll.net import chunked
from atoll.net import log as _log
from atoll.net.auth import from_controller
from atoll.net.rpc import rpc_handler, rpc_stream_handler

log = logging.getLogger("atoll.controller")


def decode_program(request: pb.PipelineProgram) -> PipelineRequest:
    """The compiler's view of a submitted program (also used by `atoll plan`, in-process)."""
    return PipelineRequest(
        model=request.model_program,
        loss=request.loss_program,
        input=spec_from_pb(request.input),
        target=spec_from_pb(request.target),
        config=JobConfig.from_pb(request.config),
        aliases=dict(request.aliases),
    )


class ControllerService(AutoResume, pb_grpc.ControllerServicer):
    def __init__(
        self,
        *,
        token: str,
        heartbeat_interval_s: float = 1.0,
        heartbeat_timeout_s: float = 5.0,
        rpc_timeout_s: float = 60.0,
        load_timeout_s: float = 120.0,
        step_timeout_s: float = 600.0,
        lease_timeout_s: float = 30.0,
        status_grace_s: float = 60.0,
    ):
        self.status_grace_s = status_grace_s
        """How long a dead worker or a failed job still shows in Status (without ``all``)."""
        self.leases = Leases(lease_timeout_s)
        self._stopped = threading.Event()
        self.controller_key = secrets.token_hex(16)
        """Given to workers as they register; every call to them carries it (runtime/worker/daemon.py)."""
        self.registry = Registry(
            token=token,
            heartbeat_interval_s=heartbeat_interval_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            rpc_timeout_s=rpc_timeout_s,
            on_death=self._worker_died,
            controller_key=self.controller_key,
        )
        self.rendezvous = Rendezvous()
        self.load_timeout_s = load_timeout_s
        self.step_timeout_s = step_timeout_s
        self.dispatcher = Dispatcher(token, controller_key=self.controller_key)
        self.gang = GangScheduler()
        self._jobs: dict[str, Job] = {}
        self._closed: set[str] = set()  # ids only: a closed job's plan and weights are dropped
        self._job_ids = itertools.count()
        self._lock = threading.Lock()
        self.admission = AdmissionQueue(self._lock)
        self._compile_lock = threading.Lock()
        self.gate = FairGate()
        self.values = ValueTable(self._free_on_holder)
        self.metrics = ControllerMetrics(self.registry.all, self._all_jobs, self._queue_length)

    # ------------------------------------------------------------------ workers

    def _worker_died(self, record: WorkerRecord) -> None:
        log.warning("%s is dead: %s", record.describe(), record.death)
        self.values.drop_worker(record.worker_id)
        for job in self._jobs_of(record):
            if job.auto_resume and job.state in (JobState.READY, JobState.LOADING):
                job.broken = f"{record.describe()} died: {record.death}"  # restored before its next step
            else:
                self._fail(job, f"{record.describe()} died: {record.death}")

    def _jobs_of(self, record: WorkerRecord) -> list[Job]:
        with self._lock:
            return [j for j in self._jobs.values() if record in j.workers]

    @rpc_handler
    def RegisterWorker(self, request, context):
        record = self.registry.register(request)
        log.info("registered %s", record.describe())
        with self._lock:
            self.admission.released()  # a queued request may fit now
        return pb.RegisterWorkerReply(
            worker_id=record.worker_id,
            heartbeat_interval_s=self.registry.heartbeat_interval_s,
            controller_key=self.controller_key,
        )

    @rpc_handler
    def Heartbeat(self, request, context):
        return pb.HeartbeatReply(known=self.registry.heartbeat(request.worker_id, request.rss_bytes))

    @rpc_handler
    def DeregisterWorker(self, request, context):
        """A stopping worker leaves at once: its jobs are handled as a dead worker's, and it is no
        longer listed. Only a registered worker may ask (its call carries the key it was given)."""
        if not from_controller(context, self.controller_key):
            raise NotPermitted("DeregisterWorker: only a worker registered with this controller may call it")
        record = self.registry.deregister(request.worker_id, "it stopped (deregistered)")
        if record is None:
            raise NotFound(f"unknown worker {request.worker_id!r}")
        return pb.Empty()

    def _all_jobs(self) -> list[Job]:
        with self._lock:
            return list(self._jobs.values())

    def _queue_length(self) -> int:
        with self._lock:
            return len(self.admission.snapshot())

    # ------------------------------------------------------------------ jobs

    def _job(self, job_id: str) -> Job:
        with self._lock:
            job = self._jobs.get(job_id)
            closed = job_id in self._closed
        if job is None:
            raise NotFound(f"job {job_id!r} was closed" if closed else f"unknown job {job_id!r}")
        return job

    def _ready_job(self, job_id: str) -> Job:
        job = self._job(job_id)
        if job.state is JobState.FAILED:
            raise JobFailed(f"job {job_id} has failed and must be submitted again: {job.error}")
        if job.state is not JobState.READY:
            raise JobFailed(f"job {job_id} is {job.state.value}")
        return job

    def _place(self, ranks: int, device: str, islands: tuple[str, ...], exclusive: bool) -> list[WorkerRecord]:
        """Call with ``self._lock`` held: the choice and the bookkeeping after it are one decision."""
        held = {jid for jid, j in self._jobs.items() if j.exclusive and j.state is not JobState.FAILED}
        return place(self.registry.live(), held, ranks, device, islands, exclusive)

    def _load_request(
        self,
        job_id: str,
        compiled: CompiledPipeline,
        at: tuple[int, int, int],
        peers: list[str],
        groups: list[str],
        store: tuple[str, str],
    ) -> pb.LoadPlanRequest:
        """The worker at ``at`` = (replica, pipeline rank, island rank). Each chain of the pipeline
        (a replica's island rank ``tp`` of every stage) meets under a prefix of its own in the
        job's rendezvous namespace ``store`` = (name, secret); each rank's replicas meet under
        another, for the gradient average; each stage's island under a third, for its
        tensor-parallel collectives."""
        replica, rank, tp = at
        topo, low = compiled.topology, compiled.lowered
        chain = "" if topo.data_parallel == topo.tensor_parallel == 1 else f"r{replica}t{tp}/"
        edges, tied = compiled.dataflow.to_pb()
        holds_last = topo.rank_of(topo.num_stages - 1) == rank
        request = pb.LoadPlanRequest(
            job_id=job_id,
            rank=rank,
            world_size=topo.ranks,
            store_namespace=store[0],
            store_secret=store[1],
            store_prefix=chain,
            replica=replica,
            replica_group_prefix=f"dp{rank}t{tp}/",
            tp_rank=tp,
            tp_group_prefix=f"tp{replica}.{rank}/",
            loss_program=compiled.loss_programs[tp] if holds_last else b"",
            actions=[a.to_pb() for a in low.actions[rank]],
            stage_ranks=topo.stage_ranks,
            config=compiled.request.config.to_pb(),
            recv_slots=[pb.RecvSlot(action=a.to_pb(), slot=slot) for a, slot in low.recv_slots[rank].items()],
            num_stages=topo.num_stages,
            peer_transports=peers,
            groups=groups,
            edges=edges,
            tied=tied,
        )
        for s in compiled.stages:  # added in place: a program may be large, a message is copied whole
            if s.rank == rank:
                request.stages.add(
                    stage=s.index,
                    input=spec_to_pb(s.input),
                    output=spec_to_pb(s.output),
                    exported_program=s.programs[tp],
                )
        return request

    def _dispatch_ordered(self, calls: list[Call], timeout_s: float, mode: str = "direct", common=None):
        """Give each call its worker's next gang position and send them all, without waiting:
        ``mode`` "direct", "relay" (a step through relaying workers; ``common`` is the request
        shared by the ranks that have none of their own) or "sequential" (JobConfig.dispatch)."""
        with self.gang.positions() as take:
            for call in calls:
                call.gang_seq, call.gang_floor = take(call.worker.worker_id)
            if mode == "direct":
                pending = self.dispatcher.submit(calls, timeout_s)
            elif mode == "relay":
                pending = self.dispatcher.relay(calls, common, timeout_s)
        if mode == "sequential":
            pending = self.dispatcher.sequential(calls, timeout_s)
        pending.on_end(lambda call: self.gang.ended(call.worker.worker_id, call.gang_seq))
        return pending

    @rpc_handler
    def SubmitPipeline(self, request, context):
        with self._compile_lock:  # torch.export's (de)serializers keep global state: one compile at a time
            compiled = compile_pipeline(decode_program(request))
        cfg, topo = compiled.request.config, compiled.topology
        # islands name each pipeline rank's island, the same for every replica and island rank
        if len(cfg.islands) == topo.ranks:
            islands = tuple(cfg.islands[topo.coordinates(i)[1]] for i in range(topo.workers))
        else:
            islands = cfg.islands
        ticket = Ticket(cfg.name, topo.workers, cfg.device, islands, cfg.exclusive)
        with self._lock:  # placement and bookkeeping are one decision
            workers = self.admission.admit(
                ticket, lambda: self._place(topo.workers, cfg.device, islands, cfg.exclusive), cfg.admission_timeout_s
            )
            job_id = f"job{next(self._job_ids)}"
            job = Job(
                job_id=job_id,
                name=compiled.request.config.name or job_id,
                compiled=compiled,
                workers=workers,
                report={},
                islands=islands,
                session="" if cfg.detached else request.session,
            )
            if job.session:
                self.leases.renew(job.session)
            self._jobs[job_id] = job
            for w in workers:
                w.jobs.add(job_id)
        try:
            self._load(job, cfg.resume_from)
            if cfg.auto_resume:  # there is always a checkpoint to resume from
                self._checkpoint(job)
        except (DispatchError, InvalidInput) as e:
            if job.fail(f"loading failed: {e}"):
                self.metrics.failed(job)
            self._unload(job, wait=True)
            if isinstance(e, InvalidInput):
                raise
            if isinstance(e.error, InvalidInput):  # a worker refused the checkpoint: say why
                raise InvalidInput(f"job {job_id} could not be loaded: {e}") from None
            raise JobFailed(f"job {job_id} could not be loaded: {e}") from None
        job.state, job.loaded_at = JobState.READY, time.monotonic()
        log.info("job %s ready on %s", job_id, ", ".join(w.worker_id for w in job.workers))
        return pb.SubmitReply(job_id=job_id, plan_json=json.dumps(job.report))

    def _load(self, job: Job, resume_from: str = "") -> None:
        """Load the job's plan on its workers (``job.workers``), in a data-plane namespace of its
        own, then their state from the checkpoint at ``resume_from`` if one is named."""
        compiled, workers = job.compiled, job.workers
        cfg, topo = compiled.request.config, compiled.topology
        chains = {}  # per (replica, island rank): the pipeline's (edges, peers, groups)
        for d in range(topo.data_parallel):
            for tp in range(topo.tensor_parallel):
                chain = [workers[i] for i in topo.pipeline_workers(d, tp)]
                edges = edge_transports(compiled.routes, chain, cfg.transport)
                peers = peer_transports(edges, topo.ranks)
                # process groups are joined by every rank of the pipeline or by none
                groups = sorted({t for row in peers.values() for t in row} & GROUP_TRANSPORTS)
                chains[d, tp] = (edges, peers, groups)
        report = compiled.report({i: f"{w.worker_id} {w.address} {w.device}" for i, w in enumerate(workers)})
        report["edges"], _, report["groups"] = chains[0, 0]
        report["name"] = job.name
        if "restores" in job.report:  # an auto_resume job's history (controller/resume.py)
            report["restores"] = job.report["restores"]
        job.report = report
        self.rendezvous.close(job.namespace)  # a job placed again meets in a fresh namespace
        job.namespace = f"{job.job_id}.{secrets.token_hex(4)}"
        store = (job.namespace, self.rendezvous.open(job.namespace))
        report["rendezvous"] = job.namespace  # its name only: the secret goes to the job's workers alone
        calls = []
        for i, w in enumerate(workers):
            d, r, tp = topo.coordinates(i)
            _, peers, groups = chains[d, tp]
            request = self._load_request(job.job_id, compiled, (d, r, tp), peers[r], groups, store)
            calls.append(Call(w, "LoadPlan", request))
        self._dispatch_ordered(calls, self.load_timeout_s).replies()
        if resume_from:
            report["resumed_from"] = self._restore(job, resume_from)

    @staticmethod
    def _check_batch(spec: EdgeSpec, tensors, refs=(), refs_at=()) -> None:
        """The step's tensors and remote values (at positions ``refs_at``) fit the edge's spec."""
        remote = [tensor_spec_from_pb(r.spec, f"edge '{spec.name}'") for r in refs]
        sent = [spec_of_pb_tensor(t) for t in tensors]
        got = interleave(sent, remote, refs_at)
        if tuple(got) != spec.tensors:
            shown = ", ".join(map(str, got)) or "nothing"
            which = "the remote values are" if refs and not tensors else "received"
            raise InvalidInput(f"edge '{spec.name}': expected {spec}, {which} {shown}")
        for t, s in zip(tensors, sent):
            if len(t.data) != s.nbytes:
                raise InvalidInput(f"edge '{spec.name}': {s} needs {s.nbytes} bytes, message carries {len(t.data)}")

    @rpc_handler
    @_log.in_context(lambda request: (request.job_id, request.seq or None))
    def Step(self, request, context):
        reads: list[str] = []  # the remote values the step reads, once acquired
        try:
            return self._step(request, reads)
        finally:
            self.values.release(reads)

    def _step(self, request: pb.StepRequest, reads: list[str]) -> pb.StepReply:
        job = self._ready_job(request.job_id)
        with job.order:  # steps go out in the client's order, each as soon as its turn comes
            seq = request.seq or job.next_seq
            self._await_turn(job, seq)
            started = time.perf_counter()
            try:  # a refused step still uses up its number, so the steps behind it do not wait
                job = self._ready_job(request.job_id)  # a worker may have died while this step waited
                mode = self._check_step(job, request)
                named = [r.value_id for r in (*request.input_refs, *request.target_refs)]
                self.values.acquire(named)  # kept until the step ends: a free meanwhile waits for it
                reads += named
                if job.auto_resume:  # one step at a time, holding the order: a failure is repaired in place
                    return self._resilient_step(job, seq, request, mode)
                pending = self._dispatch_step(job, seq, request, mode)
            finally:
                job.next_seq = seq + 1
                job.order.notify_all()
        try:  # waiting happens outside the order: the next step can be dispatched meanwhile
            replies = pending.replies()
        except DispatchError as e:
            cause = self._blame(job, e)
            self._fail(job, f"step {seq} failed: {cause}")
            raise JobFailed(
                f"job {job.job_id} step {seq} failed; the job must be submitted again. Cause: {cause}"
            ) from None
        finally:
            self.gate.leave(job.job_id)
        if mode == "train":  # status counts training steps
            with job.order:
                job.steps += 1
        reply = self._step_reply(job, seq, replies)
        job.stepped(mode, reply.loss, replies)
        self.metrics.step(job, mode, time.perf_counter() - started, replies)
        return reply

    def _check_step(self, job: Job, request: pb.StepRequest) -> str:
        """The step's mode, once its batch matches the job's specs; raises InvalidInput otherwise."""
        topo = job.compiled.topology
        mode = request.mode or "train"
        if mode not in STEP_MODES:
            raise InvalidInput(f"unknown step mode {mode!r} (known: {', '.join(STEP_MODES)})")
        input_refs, target_refs = request.input_refs, request.target_refs  # their holders: at dispatch
        self._check_batch(job.compiled.request.input, request.inputs, input_refs, request.input_ref_at)
        if mode == "forward":
            if request.targets or target_refs:
                raise InvalidInput("a forward step takes no target")
        else:
            self._check_batch(job.compiled.request.target, request.targets, target_refs, request.target_ref_at)
        if request.keep_outputs and mode != "forward":
            raise InvalidInput("only a forward step keeps its output on the workers")
        if topo.workers > topo.ranks and (input_refs or target_refs or request.keep_outputs):
            raise InvalidInput(
                "a data- or tensor-parallel job takes and returns tensors, not remote values (not built yet)"
            )
        return mode

    def _dispatch_step(self, job: Job, seq: int, request: pb.StepRequest, mode: str):
        """Send step ``seq`` to every worker of the job, in gang order; the caller waits for the
        replies and then calls ``self.gate.leave(job.job_id)``."""
        topo = job.compiled.topology
        readers, last = job.compiled.batch_ranks, topo.rank_of(topo.num_stages - 1)
        input_refs = self._resolve_refs(request.input_refs)
        target_refs = self._resolve_refs(request.target_refs)
        replicas = topo.data_parallel
        common = pb.RunStepRequest(job_id=job.job_id, step=seq, mode=mode)
        own = {}  # the requests of the workers that read the batch or hold the last stage
        for d in range(replicas):  # each replica reads its own rows of the batch
            inputs = [shard_rows(t, d, replicas) for t in request.inputs]
            targets = [shard_rows(t, d, replicas) for t in request.targets]
            for r, tp in itertools.product({*readers, last}, range(topo.tensor_parallel)):
                own[topo.worker(d, r, tp)] = pb.RunStepRequest(
                    job_id=job.job_id,
                    step=seq,
                    inputs=inputs if r in readers else [],
                    targets=targets if r == last else [],
                    input_refs=input_refs if r in readers else [],
                    target_refs=target_refs if r == last else [],
                    input_ref_at=request.input_ref_at if r in readers else [],
                    target_ref_at=request.target_ref_at if r == last else [],
                    keep_outputs=request.keep_outputs and r == last,
                    mode=mode,
                )
        calls = [Call(w, "RunStep", own.get(i, common)) for i, w in enumerate(job.workers)]
        # fair between jobs sharing workers (controller/cluster/fairness.py), then in gang order
        self.gate.enter(job.job_id, job.worker_ids, job.weight)
        try:
            return self._dispatch_ordered(calls, self.step_timeout_s, job.dispatch_mode, common)
        except BaseException:
            self.gate.leave(job.job_id)
            raise

    def _step_reply(self, job: Job, seq: int, replies: list) -> pb.StepReply:
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
            kept_outputs=[self._kept(job.workers[last], k) for k in replies[last].kept_outputs],
        )

    def _kept(self, worker: WorkerRecord, ref: pb.RemoteRef) -> pb.RemoteRef:
        """A forward step's output kept on ``worker``: a live value from now on."""
        self.values.add(ref.value_id, worker.worker_id)
        return self._holder_ref(worker, ref)

    PROBE_TIMEOUT_S = 2.0

    def _blame(self, job: Job, error: DispatchError) -> str:
        """Name the cause of a failed step. When a worker dies, its peers' data-plane receives
        often fail before the controller hears anything from (or about) the dead one, so the
        first error to arrive is a survivor's. Ping every worker of the job: the unreachable
        ones are marked dead and named first, so the caller learns which worker to look at."""
        if error.code == grpc.StatusCode.UNAVAILABLE:
            self.registry.mark_dead(error.worker, f"unreachable during a step: {error.error}")
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
            return str(error)
        named = ", ".join(w.describe() for w in dead)
        return f"{named} unreachable (did the worker die?); a peer reported: {error}"

    STEP_ORDER_TIMEOUT_S = 30.0

    # ------------------------------------------------------------------ remote values

    @staticmethod
    def _holder_ref(worker: WorkerRecord, ref: pb.RemoteRef) -> pb.RemoteRef:
        return pb.RemoteRef(
            value_id=ref.value_id, worker_id=worker.worker_id, address=worker.value_address, spec=ref.spec
        )

    def _holder(self, ref: pb.RemoteRef) -> WorkerRecord:
        worker = self.registry.get(ref.worker_id)
        if worker is None or not worker.alive:
            raise NotFound(f"remote value {ref.value_id}: its worker {ref.worker_id!r} is gone, and the value with it")
        return worker

    def _resolve_refs(self, refs) -> list[pb.RemoteRef]:
        """The references with their holders' current value-server addresses (checked alive)."""
        return [self._holder_ref(self._holder(r), r) for r in refs]

    @rpc_handler
    def PutValue(self, request, context):
        """Place a tensor on a worker (of ``island``, least loaded) and keep it there."""
        with self._lock:
            workers = [w for w in self.registry.live() if not request.island or w.island == request.island]
            if not workers:
                raise NotEnoughWorkers(f"no live worker on island {request.island!r} to hold a value")
            worker = min(workers, key=lambda w: (len(w.jobs), int(w.worker_id[1:])))
        value_id = uuid.uuid4().hex
        worker.endpoint.call("PutValue", pb.PutValueRequest(tensor=request.tensor, value_id=value_id))
        self.values.add(value_id, worker.worker_id)
        spec = tensor_spec_to_pb(spec_of_pb_tensor(request.tensor))
        return self._holder_ref(worker, pb.RemoteRef(value_id=value_id, spec=spec))

    @rpc_handler
    def GetValue(self, request, context):
        self.values.check([request.value_id])
        return self._holder(request).endpoint.call("GetValue", request)

    @rpc_handler
    def FreeValue(self, request, context):
        """Free a value once the steps already submitted that read it have ended (idempotent)."""
        self.values.free(request.value_id)
        return pb.Empty()

    def _free_on_holder(self, value_id: str, worker_id: str) -> None:
        worker = self.registry.get(worker_id)
        if worker is None or not worker.alive:
            return  # the value went with its worker
        try:
            worker.endpoint.call("FreeValue", pb.RemoteRef(value_id=value_id, worker_id=worker_id))
        except AtollError as e:  # the worker may be dying; its values go with it
            log.warning("freeing remote value %s on %s: %s", value_id, worker.describe(), e)

    def _await_turn(self, job: Job, seq: int) -> None:
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

    @rpc_handler
    def GetState(self, request, context):
        job = self._ready_job(request.job_id)
        # every replica holds the same weights: replica 0's are read, from every rank of each island
        compiled = job.compiled
        replica0 = job.workers[: compiled.topology.ranks * compiled.topology.tensor_parallel]
        calls = [Call(w, "GetState", pb.GetStateRequest(job_id=job.job_id)) for w in replica0]
        with job.order:  # after every step the client has sent so far
            pending = self._dispatch_ordered(calls, self.step_timeout_s)
        replies = pending.replies()
        pieces: dict[str, dict[int, pb.TensorData]] = {}  # name -> island rank -> tensor
        for i, reply in enumerate(replies):
            for t in reply.tensors:  # a tied parameter comes from each holder, alike
                pieces.setdefault(t.name, {})[compiled.topology.coordinates(i)[2]] = t.tensor
        cuts, tensors = compiled.cuts, {}
        for name, by_rank in pieces.items():
            cut = cuts.get(name)  # a tensor-parallel piece per island rank, joined here; else whole on each
            whole = (
                by_rank[0]
                if cut is None
                else tensor_to_pb(cut.join([tensor_from_pb(by_rank[t], name) for t in sorted(by_rank)]))
            )
            tensors[name] = pb.NamedTensor(name=name, tensor=whole)
        for alias, name in job.compiled.request.aliases.items():  # the model's other names of shared tensors
            if name in tensors:
                tensors[alias] = pb.NamedTensor(name=alias, tensor=tensors[name].tensor)
        return pb.StateReply(tensors=list(tensors.values()))

    @rpc_handler
    def Save(self, request, context):
        job = self._ready_job(request.job_id)
        if not request.path:
            raise InvalidInput("a checkpoint needs a path")
        try:
            version, step = self._save(job, request.path)
        except DispatchError as e:
            cause = self._blame(job, e)  # a worker that died is marked dead, and the job fails
            message = f"saving job {job.job_id} failed; the previous checkpoint is kept. Cause: {cause}"
            if job.auto_resume and not all(w.alive for w in job.workers):
                job.broken = cause  # restored before its next step (controller/resume.py)
                raise InvalidInput(message + " (the job is restored before its next step)") from None
            if not all(w.alive for w in job.workers):
                self._fail(job, f"saving failed: {cause}")
                raise JobFailed(message) from None
            raise InvalidInput(message) from None
        return pb.SaveReply(path=request.path, version=version.name, step=step)

    def _save(self, job: Job, path: str):
        """Every worker of replica 0 writes its own tensors into a new version of the checkpoint at
        ``path``; the manifest and the switch of ``current`` come last (atoll.core.checkpoint).
        Returns (version directory, step); a failed save removes its version and raises DispatchError."""
        compiled, topo = job.compiled, job.compiled.topology
        if compiled.request.config.zero:
            raise InvalidInput("checkpoints of ZeRO-1 jobs are not built yet (the optimizer state is a flat shard)")
        with job.order:  # after every step the client has sent so far
            step = job.steps  # training steps taken (the client waits for its steps before saving)
            version = checkpoint.new_version(path, step)
            replica0 = list(enumerate(job.workers[: topo.ranks * topo.tensor_parallel]))
            files = {i: checkpoint.worker_file(*topo.coordinates(i)[1:]) for i, _ in replica0}
            calls = [
                Call(w, "SaveState", pb.SaveStateRequest(job_id=job.job_id, directory=str(version), file=files[i]))
                for i, w in replica0
            ]
            pending = self._dispatch_ordered(calls, self.step_timeout_s)
        try:
            replies = pending.settle().replies()  # no worker still writing when a failed version goes
        except DispatchError:
            checkpoint.discard(version)
            raise
        cfg = compiled.request.config
        manifest = {
            "step": step,
            "layout": job.report["layout"],
            "optimizer": cfg.optimizer,
            "optimizer_args": cfg.optimizer_args,
            "cuts": {n: c.to_json() for n, c in compiled.cuts.items()},
            "files": [
                {"file": files[i], "rank": topo.coordinates(i)[1], "tp": topo.coordinates(i)[2]}
                | {"keys": json.loads(r.keys_json)}
                for (i, _), r in zip(replica0, replies)
            ],
        }
        checkpoint.commit(version, manifest)
        return version, step

    def _restore(self, job: Job, path: str) -> dict:
        """Load every worker's state from the checkpoint at ``path``, cut for this job's layout."""
        version, manifest = checkpoint.open_current(path)
        cfg = job.compiled.request.config
        if manifest["optimizer"] != cfg.optimizer:
            raise InvalidInput(
                f"the checkpoint at {path} holds {manifest['optimizer']} state; this job uses {cfg.optimizer}"
            )
        cuts = json.dumps({n: c.to_json() for n, c in job.compiled.cuts.items()})
        request = pb.LoadStateRequest(job_id=job.job_id, directory=str(version), cuts_json=cuts)
        self._dispatch_ordered([Call(w, "LoadState", request) for w in job.workers], self.load_timeout_s).replies()
        job.steps = manifest["step"]  # the job's training steps go on counting from the checkpoint's
        return {"path": path, "version": version.name, "step": manifest["step"]}

    @rpc_stream_handler
    def Chunked(self, request_iterator, context):
        yield from chunked.serve(self, "Controller", request_iterator, context)

    @rpc_handler
    def Rendezvous(self, request, context):
        return self.rendezvous.serve(request)

    @rpc_handler
    def GetPlan(self, request, context):
        job = self._job(request.job_id)
        with job.order:
            return pb.PlanReply(plan_json=json.dumps(job.report), next_step=job.next_seq)

    @rpc_handler
    def GetTimeline(self, request, context):
        """The job's measured timelines of the asked steps beside the predicted one (controller/compiler/trace.py)."""
        job = self._ready_job(request.job_id)
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

    def _unload(self, job: Job, wait: bool) -> None:
        """Unload the job from its live workers (waiting for their answers, or not) and stop
        counting it in their load."""
        live = [w for w in job.workers if w.alive]
        calls = [Call(w, "Unload", pb.JobRef(job_id=job.job_id)) for w in live]
        if wait:
            self.dispatcher.each(calls, 10.0)
        else:
            self.dispatcher.submit(calls, 10.0)
        self.rendezvous.close(job.namespace)
        with self._lock:
            for w in job.workers:
                w.jobs.discard(job.job_id)
            self.admission.released()

    def _fail(self, job: Job, reason: str) -> None:
        """Fail the job and free what it holds on its workers at once (nothing can use it any
        more); its record and error stay for status until the client closes it."""
        if job.fail(reason):
            self.metrics.failed(job)
            self._unload(job, wait=False)

    @rpc_handler
    def CloseJob(self, request, context):
        with self._lock:
            if request.job_id in self._closed:
                return pb.Empty()  # closing twice is fine
        self._close(self._job(request.job_id))
        return pb.Empty()

    def _close(self, job: Job) -> None:
        if job.state is not JobState.FAILED:  # a failed job was unloaded when it failed
            self._unload(job, wait=True)
        job.state = JobState.CLOSED
        with self._lock:
            self._jobs.pop(job.job_id, None)
            self._closed.add(job.job_id)
            held = {j.session for j in self._jobs.values()}
        self.gate.forget(job.job_id)
        self.metrics.forget(job)
        if job.session and job.session not in held:
            self.leases.forget(job.session)

    @rpc_handler
    def Ping(self, request, context):
        return pb.Empty()

    @rpc_handler
    def KeepAlive(self, request, context):
        if request.session:
            self.leases.renew(request.session)
        return pb.KeepAliveReply(lease_timeout_s=self.leases.timeout_s)

    def run_lease_checks(self) -> None:
        """Close, in the background, every job whose client session's lease has run out."""

        def loop():
            while not self._stopped.wait(min(1.0, self.leases.timeout_s / 4)):
                with self._lock:
                    jobs = list(self._jobs.values())
                for job in jobs:
                    ended = job.state in (JobState.READY, JobState.FAILED)
                    if job.session and ended and self.leases.expired(job.session):
                        log.warning("job %s: its client's lease ran out; closing it", job.job_id)
                        try:
                            self._close(job)
                        except Exception:  # noqa: BLE001 (the next sweep tries again)
                            log.exception("closing job %s failed", job.job_id)

        threading.Thread(target=loop, name="leases", daemon=True).start()

    @rpc_handler
    def Status(self, request, context):
        now = time.monotonic()
        with self._lock:
            jobs = list(self._jobs.values())
            queue = self.admission.snapshot()
        shown = lambda ended_at: request.all or not ended_at or now - ended_at <= self.status_grace_s  # noqa: E731
        workers = [w for w in self.registry.all() if w.alive or shown(w.died_at)]
        jobs = [j for j in jobs if j.state is not JobState.FAILED or shown(j.failed_at)]
        return pb.StatusReply(
            queue=[
                pb.QueuedRequest(
                    name=t.name,
                    ranks=t.ranks,
                    device=t.device,
                    islands=t.islands,
                    exclusive=t.exclusive,
                    waited_s=now - t.since,
                )
                for t in queue
            ],
            workers=[
                pb.WorkerInfo(
                    worker_id=w.worker_id,
                    address=w.address,
                    device=w.device,
                    host=w.host,
                    alive=w.alive,
                    seconds_since_heartbeat=now - w.last_heartbeat,
                    jobs=sorted(w.jobs),
                    pid=w.pid,
                    island=w.island,
                    rss_bytes=w.rss_bytes,
                )
                for w in workers
            ],
            jobs=[
                pb.JobInfo(
                    job_id=j.job_id,
                    name=j.name,
                    state=j.state.value,
                    workers=[w.worker_id for w in j.workers],
                    steps=j.steps,
                    schedule=j.compiled.topology.schedule,
                    stages=j.compiled.topology.ranks,
                    error=j.error,
                    steps_per_s=j.steps / max(now - j.loaded_at, 1e-9),
                    exclusive=j.exclusive,
                    has_loss=j.last_loss is not None,
                    last_loss=j.last_loss or 0.0,
                    predicted_peak_bytes=j.predicted_peak_bytes,
                    measured_peak_bytes=j.measured_peak_bytes,
                )
                for j in jobs
            ],
        )

    def stop(self) -> None:
        self._stopped.set()
        self.registry.stop()
        self.dispatcher.close()
        self.metrics.close()
