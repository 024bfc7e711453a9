"""Bringing a submitted pipeline onto workers: compile it, admit and place it, and load its plan
there (each worker's LoadPlanRequest, the pipeline's transports, the plan report)."""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

from atoll._rpc import atoll_pb2 as pb
from atoll.controller import bases, heap
from atoll.controller.cluster.dispatch import Call, DispatchError
from atoll.controller.cluster.rendezvous import Rendezvous
from atoll.controller.cluster.transports import (
    GROUP_TRANSPORTS,
    edge_transports,
    peer_transports,
    replica_transport,
)
from atoll.controller.compiler.pipeline import CompiledPipeline, PipelineRequest, compile_pipeline
from atoll.controller.gang import Gang
from atoll.controller.jobs import Job, JobState
from atoll.controller.lifecycle import Lifecycle
from atoll.controller.state import StateStore
from atoll.controller.statedir import JobRow, MemoryState
from atoll.core.config import JobConfig, WorkerSettings
from atoll.core.wire import spec_from_pb, spec_to_pb
from atoll.errors import InvalidInput, JobFailed

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


def load_request(
    job_id: str,
    compiled: CompiledPipeline,
    at: tuple[int, int, int],
    peers: list[str],
    groups: list[str],
    store: tuple[str, str],
    dataflow: tuple[list[pb.DataflowEdge], list[pb.TiedParameter]],
) -> pb.LoadPlanRequest:
    """The worker at ``at`` = (replica, pipeline rank, island rank), with its place in the job's
    mesh: each of its groups (a replica's island rank ``tp`` of every stage, for the pipeline's
    transfers; each rank's replicas, for the gradient average; each stage's island, for its
    tensor-parallel collectives) meets under the group's name in the job's rendezvous namespace
    ``store`` = (name, secret). ``dataflow``: the job's ``Dataflow.to_pb()``, made once for all
    its workers (for a 1,024-stage chain, 15 ms of the controller's CPU per worker)."""
    replica, rank, tp = at
    topo, low = compiled.topology, compiled.lowered
    edges, tied = dataflow
    holds_last = topo.rank_of(topo.num_stages - 1) == rank
    request = pb.LoadPlanRequest(
        job_id=job_id,
        mesh=topo.mesh.place(topo.worker(replica, rank, tp)).to_pb(),
        settings=WorkerSettings.of(compiled.request.config).to_pb(),
        store_namespace=store[0],
        store_secret=store[1],
        loss_program=compiled.loss_programs[tp] if holds_last else b"",
        actions=[a.to_pb() for a in low.actions[rank]],
        stage_ranks=topo.stage_ranks,
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


@dataclass(kw_only=True, eq=False)
class Loader:
    lifecycle: Lifecycle
    """Admits and places the job, and fails it if it cannot be loaded."""
    gang: Gang
    """Sends the plan to the workers in gang order: ahead of any step of theirs sent after it."""
    state: StateStore
    """Restores the checkpoint named by ``resume_from``, and writes an auto_resume job's first one."""
    rendezvous: Rendezvous
    records: MemoryState
    """The state directory: a job's program, placement and state are recorded there."""
    load_timeout_s: float
    _compile_lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def compile(self, request: pb.PipelineProgram) -> CompiledPipeline:
        """A submitted program compiled (also a restarted controller's recorded one, controller/recovery.py)."""
        with self._compile_lock:  # torch.export's (de)serializers keep global state: one compile at a time
            compiled = compile_pipeline(decode_program(request))
        # the stages' programs carry the weights from here on: the job does not hold the model twice
        return dataclasses.replace(compiled, request=dataclasses.replace(compiled.request, model=b""))

    def submit(self, request: pb.PipelineProgram) -> pb.SubmitReply:
        base = None
        if request.config.base:
            base = bases.resident(self.lifecycle.jobs, request.config.base)
            bases.cut_like(base, request)
        elif request.config.base_name:
            bases.refuse_duplicate(self.lifecycle.jobs, request.config.base_name)
        compiled = self.compile(request)
        cfg, topo = compiled.request.config, compiled.topology
        if base is not None:
            bases.check_fits(compiled, base)
        # islands name each pipeline rank's island, the same for every replica and island rank
        if len(cfg.islands) == topo.ranks:
            islands = tuple(cfg.islands[topo.coordinates(i)[1]] for i in range(topo.workers))
        else:
            islands = cfg.islands
        session = "" if cfg.detached else request.session
        job = self.lifecycle.admit(compiled, islands, session, on=base.workers if base is not None else None)
        job.base = base.job_id if base is not None else ""
        row = JobRow(
            job_id=job.job_id,
            name=job.name,
            session=job.session,
            islands=job.islands,
            placement=tuple(w.worker_id for w in job.workers),
            namespace="",
            secret="",
            state=JobState.LOADING.value,
            error="",
            steps_at_load=0,
            report={},
        )
        self.records.job_admitted(row, request)
        try:
            self.load(job, cfg.resume_from)
            if cfg.auto_resume:  # there is always a checkpoint to resume from
                self.state.checkpoint(job)
        except (DispatchError, InvalidInput) as e:
            self.lifecycle.fail_loading(job, f"loading failed: {e}")
            if isinstance(e, InvalidInput):
                raise
            if isinstance(e.error, InvalidInput):  # a worker refused the checkpoint: say why
                raise InvalidInput(f"job {job.job_id} could not be loaded: {e}") from None
            raise JobFailed(f"job {job.job_id} could not be loaded: {e}") from None
        with job.order:  # a worker may have died during the load: the job failed, and stays failed
            if job.state is JobState.FAILED:
                raise JobFailed(f"job {job.job_id} could not be loaded: {job.error}")
            job.state, job.loaded_at = JobState.READY, time.monotonic()
        self.records.job_state(job.job_id, JobState.READY.value)
        heap.settle(job.job_id, topo.ranks)  # a large plan lives as long as the job: out of the collector's scans
        log.info("job %s ready on %s", job.job_id, ", ".join(w.worker_id for w in job.workers))
        return pb.SubmitReply(job_id=job.job_id, plan_json=json.dumps(job.report))

    def load(self, job: Job, resume_from: str = "") -> None:
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
        report["replica_transport"] = replicas = replica_transport(workers, topo.data_parallel, cfg.zero, cfg.transport)
        report["name"] = job.name
        report["base_name"], report["base"] = cfg.base_name, cfg.base
        if "restores" in job.report:  # an auto_resume job's history (controller/resume.py)
            report["restores"] = job.report["restores"]
        job.report = report
        self.rendezvous.close(job.namespace)  # a job placed again meets in a fresh namespace
        job.namespace = f"{job.job_id}.{secrets.token_hex(4)}"
        store = (job.namespace, self.rendezvous.open(job.namespace))
        report["rendezvous"] = job.namespace  # its name only: the secret goes to the job's workers alone
        calls, dataflow = [], compiled.dataflow.to_pb()
        for i, w in enumerate(workers):
            d, r, tp = topo.coordinates(i)
            _, peers, groups = chains[d, tp]
            request = load_request(job.job_id, compiled, (d, r, tp), peers[r], groups, store, dataflow)
            request.base_job, request.replica_transport = job.base, replicas
            calls.append(Call(w, "LoadPlan", request))
        self.gang.dispatch(calls, self.load_timeout_s).replies()
        if resume_from:
            report["resumed_from"] = self.state.restore(job, resume_from)
        # the workers count their steps afresh: from here on, every step ending here is counted
        job.steps_at_load, job.counted_up_to = job.steps, 0
        placement = [w.worker_id for w in workers]
        self.records.job_loaded(job.job_id, placement, job.namespace, store[1], job.steps, report)
