"""The Controller gRPC service: each RPC checks its caller where it must and hands the work to the
part of the controller that does it (the parts are built, and wired to each other, here)."""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading

from atoll._rpc import atoll_pb2 as pb
from atoll._rpc import atoll_pb2_grpc as pb_grpc
from atoll.controller import bases
from atoll.controller.cluster.dispatch import Dispatcher
from atoll.controller.cluster.fairness import FairGate
from atoll.controller.cluster.leases import Leases
from atoll.controller.cluster.metrics import ControllerMetrics
from atoll.controller.cluster.registry import Registry
from atoll.controller.cluster.rendezvous import Rendezvous
from atoll.controller.gang import Gang, batch_route
from atoll.controller.jobs import JobTable
from atoll.controller.lifecycle import Lifecycle
from atoll.controller.loading import Loader
from atoll.controller.loading import decode_program as decode_program  # `atoll plan` imports it from here
from atoll.controller.parameter_servers import ParameterServers
from atoll.controller.recovery import Recovery
from atoll.controller.remote import RemoteValues
from atoll.controller.resume import AutoResume
from atoll.controller.state import StateStore
from atoll.controller.statedir import MemoryState, StateDir, WorkerRow
from atoll.controller.status import Reports
from atoll.controller.stepping import Stepper
from atoll.errors import NotFound, NotPermitted
from atoll.net import log as _log
from atoll.net.auth import from_controller
from atoll.net.rpc import chunked_method, rpc_handler

log = logging.getLogger("atoll.controller")


def _first_step(request: pb.StepsRequest) -> tuple[str, int | None]:
    """The log context of several steps: their job and the first one's number."""
    first = request.steps[0] if request.steps else pb.StepRequest()
    return first.job_id, first.seq or None


class ControllerService(pb_grpc.ControllerServicer):
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
        state_dir: str | None = None,
    ):
        self.records = StateDir(state_dir) if state_dir else MemoryState()
        self.leases = Leases(lease_timeout_s)
        self._stopped = threading.Event()
        self.controller_key = secrets.token_hex(16)
        """Given to workers as they register; every call to them carries it (runtime/worker/daemon.py)."""
        self.registry = Registry(
            token=token,
            heartbeat_interval_s=heartbeat_interval_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            rpc_timeout_s=rpc_timeout_s,
            # a worker dies only once the service serves, when self.lifecycle exists
            on_death=self._worker_died,
            controller_key=self.controller_key,
        )
        self.rendezvous = Rendezvous()
        self.dispatcher = Dispatcher(token, controller_key=self.controller_key)
        self.registry.busy = self.dispatcher.loading  # a worker taking a large plan may miss heartbeats
        self.jobs = JobTable(self.records)
        self.gate = FairGate()
        self.values = RemoteValues(self.registry, self.jobs.lock)
        self.metrics = ControllerMetrics(self.registry.all, self.jobs.all, self.jobs.queue_length)
        self.step_timeout_s, self.load_timeout_s = step_timeout_s, load_timeout_s
        # each collaborator's fields name the parts it is given (see _build)
        self.gang = self._build(Gang)
        self.lifecycle = self._build(Lifecycle)
        self.state = self._build(StateStore)
        self.loader = self._build(Loader)
        self.stepper = self._build(Stepper, resume=self._build(AutoResume), values=self.values.table)
        self.reports = self._build(Reports, status_grace_s=status_grace_s)
        self.recovery = self._build(Recovery)
        self.parameter_servers = ParameterServers(
            place=self.lifecycle.place,
            jobs_lock=self.jobs.lock,
            leases=self.leases,
            token=token,
            controller_key=self.controller_key,
            timeout_s=load_timeout_s,
            records=self.records,
        )
        self.leases.held_elsewhere = self.parameter_servers.holds_session
        # a restart on a state directory: its workers and jobs, before serving (read once: the
        # programs it holds can be large)
        recorded = self.records.read()
        self.recovery.start(recorded)
        self.parameter_servers.recover(recorded.ps_jobs, self.registry)

    def _worker_died(self, record) -> None:
        self.lifecycle.worker_died(record)
        self.parameter_servers.worker_died(record)

    def _build(self, collaborator: type, **given):
        """A collaborator (a dataclass) whose fields name the parts it needs: each is ``given`` or
        this service's part of that name, so the wiring is written once, in the field list."""
        names = [f.name for f in dataclasses.fields(collaborator) if f.init]
        return collaborator(**{n: given[n] if n in given else getattr(self, n) for n in names})

    # ------------------------------------------------------------------ workers

    @rpc_handler
    def RegisterWorker(self, request, context):
        record = self.registry.register(request)
        self.records.worker(WorkerRow(record.worker_id, record.address, record.device, record.island, record.host))
        held = list(request.held_jobs)
        # after a restart: its jobs taken back, pipelines and parameter servers
        keep = self.recovery.returned(record, held) + self.parameter_servers.returned(record, held)
        log.info("registered %s", record.describe())
        self.jobs.released()  # a queued request may fit now
        return pb.RegisterWorkerReply(
            worker_id=record.worker_id,
            heartbeat_interval_s=self.registry.heartbeat_interval_s,
            controller_key=self.controller_key,
            keep_jobs=keep,
        )

    @rpc_handler
    def Heartbeat(self, request, context):
        """Known only with the key this controller gave at registration: a worker that registered
        with an earlier controller (restarted on the same address) drops its jobs and registers again."""
        mine = from_controller(context, self.controller_key)
        known = mine and self.registry.heartbeat(request.worker_id, request.rss_bytes, request.running_steps)
        if known:
            self.recovery.heard(self.registry.get(request.worker_id))  # after a restart: its jobs taken back
        return pb.HeartbeatReply(known=known)

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

    # ------------------------------------------------------------------ jobs

    @rpc_handler
    def SubmitPipeline(self, request, context):
        return self.loader.submit(request)

    @rpc_handler
    @_log.in_context(lambda request: (request.job_id, request.seq or None))
    def Step(self, request, context):
        return self.stepper.step(request)

    @rpc_handler
    @_log.in_context(_first_step)
    def Steps(self, request, context):
        """Consecutive steps of one job in one call (Job.steps_async), as one RunSteps per worker."""
        return self.stepper.steps(request)

    @rpc_handler
    def GetState(self, request, context):
        return self.state.get_state(bases.readable(self.jobs.ready(request.job_id), request.session))

    @rpc_handler
    def Save(self, request, context):
        return self.state.save(bases.readable(self.jobs.ready(request.job_id), request.session), request.path)

    @rpc_handler
    def BatchRoute(self, request, context):
        """Where the client may post the job's batches itself (StepRequest.direct); no readers for
        an auto_resume job, whose batches the controller keeps to run a step again elsewhere."""
        job = self.jobs.ready(request.job_id)
        return pb.BatchRouteReply() if job.auto_resume else batch_route(job)

    @rpc_handler
    def GetPlan(self, request, context):
        return self.reports.plan(request.job_id)

    @rpc_handler
    def GetTimeline(self, request, context):
        """The job's measured timelines of the asked steps beside the predicted one (controller/compiler/trace.py)."""
        return self.reports.timeline(request)

    @rpc_handler
    def SubmitParameterServer(self, request, context):
        return self.parameter_servers.submit(request)

    @rpc_handler
    def CloseJob(self, request, context):
        if self.parameter_servers.owns(request.job_id):
            self.parameter_servers.close(request.job_id)
            return pb.Empty()
        self.lifecycle.close_id(request.job_id)
        return pb.Empty()

    # ------------------------------------------------------------------ remote values

    @rpc_handler
    def PutValue(self, request, context):
        """Place a tensor on a worker (the one named, else the least loaded of ``island``) and keep it there."""
        return self.values.put(request)

    @rpc_handler
    def GetValue(self, request, context):
        """A value's tensor, read from the worker that holds it."""
        return self.values.get(request)

    @rpc_handler
    def FreeValue(self, request, context):
        """Free a value once the steps already submitted that read it have ended (idempotent)."""
        self.values.table.free(request.value_id)
        return pb.Empty()

    # ------------------------------------------------------------------ the service itself

    Chunked = chunked_method("Controller")

    @rpc_handler
    def Rendezvous(self, request, context):
        return self.rendezvous.serve(request)

    @rpc_handler
    def Ping(self, request, context):
        return pb.Empty()

    @rpc_handler
    def KeepAlive(self, request, context):
        if request.session:
            self.leases.renew(request.session)
        return pb.KeepAliveReply(lease_timeout_s=self.leases.timeout_s)

    @rpc_handler
    def Status(self, request, context):
        reply = self.reports.status(request)
        reply.jobs.extend(self.parameter_servers.infos())
        return reply

    def run_lease_checks(self) -> None:
        """Close, in the background, every job whose client session's lease has run out."""
        self.lifecycle.run_lease_checks(self._stopped)
        self.parameter_servers.run_lease_checks(self._stopped)

    def stop(self) -> None:
        self._stopped.set()
        self.registry.stop()
        self.dispatcher.close()
        self.metrics.close()
        self.records.close()
