"""The worker daemon: owns one device, registers with the controller, loads plans, runs steps.

Workers interpret, they do not decide: everything they run arrives in a plan compiled by the
controller. Stage programs arrive as exported graphs and load with pickle refused.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import torch

from atoll._rpc import atoll_pb2 as pb
from atoll._rpc import atoll_pb2_grpc as pb_grpc
from atoll.core import checkpoint
from atoll.core.actions import Action
from atoll.core.config import JobConfig
from atoll.core.dataflow import Dataflow, Routes
from atoll.core.graphs import BlockGraph, StageGraph, deserialize, forbid_pickle, on_device
from atoll.core.shards import ParamShard
from atoll.core.wire import interleave, spec_from_pb, tensor_from_pb, tensor_spec_to_pb, tensor_to_pb
from atoll.errors import (
    AtollError,
    DeadlineExceeded,
    InvalidInput,
    JobFailed,
    NotFound,
    NotPermitted,
    Unauthenticated,
    WorkerUnavailable,
)
from atoll.net import address as _address
from atoll.net import chunked
from atoll.net import log as _log
from atoll.net.auth import from_controller
from atoll.net.relay import Relay
from atoll.net.rpc import Endpoint, Health, make_server, rpc_handler, rpc_stream_handler
from atoll.worker.executor.interpreter import PipelineExecutor, StageSetup
from atoll.worker.rendezvous import ControllerStore
from atoll.worker.transports.cuda_ipc import CudaIpcTransport
from atoll.worker.transports.gloo import DataPlaneError, GlooTransport, PeerTransports
from atoll.worker.transports.nccl import NcclTransport
from atoll.worker.turnstile import Turnstile
from atoll.worker.values import ValueStore, pull

log = logging.getLogger("atoll.worker.daemon")


def _check_plan(routes: Routes, request: pb.LoadPlanRequest) -> None:
    """Refuse a plan whose graph does not fit together (ValueError), before anything is built."""
    n = request.num_stages
    if len(request.stage_ranks) != n or any(not 0 <= r < request.world_size for r in request.stage_ranks):
        raise ValueError(
            f"stage_ranks {list(request.stage_ranks)} do not place {n} stages on {request.world_size} ranks"
        )
    mine = {sp.stage: sp for sp in request.stages}
    for e in routes.flow.edges:
        if not (-1 <= e.src < n and 0 <= e.dst < n) or len(e.src_indices) != len(e.spec.tensors):
            raise ValueError(f"malformed dataflow edge {e.spec.name} ({e.src} -> {e.dst})")
        if e.dst in mine and (
            len(e.dst_indices) != len(e.spec.tensors)
            or max(e.dst_indices, default=-1) >= len(mine[e.dst].input.tensors)
        ):
            raise ValueError(f"dataflow edge {e.spec.name} does not fit the inputs of stage {e.dst}")
    for t in routes.flow.tied:
        if any(not 0 <= s < n for s in t.stages):
            raise ValueError(f"tied parameter {t.name} names a stage outside 0..{n - 1}")


def check_device(device: str) -> None:
    """Refuse (InvalidInput) a device this process cannot use, before anything is started."""
    try:
        kind = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidInput(f"device {device!r} is not a torch device ({e})") from None
    if kind.type == "cpu":
        return
    if kind.type != "cuda":
        raise InvalidInput(f"device {device!r}: a worker runs on cpu or cuda:N")
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise InvalidInput(f"device {device}: {why} (torch {torch.__version__})")
    if kind.index is not None and kind.index >= torch.cuda.device_count():
        raise InvalidInput(f"device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")


def rss_bytes() -> int:
    """This process's resident memory (sent with each heartbeat)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux: the peak instead (KiB on Linux, bytes on macOS)
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


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
        self._lock = threading.Lock()
        self.turnstile = Turnstile()
        self.relay = Relay(token, self._step_in_turn)
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

    def drop_all_jobs(self) -> None:
        """Forget every job: a new controller does not know them, so nobody could close them."""
        with self._lock:
            executors, self._jobs = list(self._jobs.values()), {}
        for executor in executors:
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
        self._use_device()
        stages = [
            StageSetup(
                index=sp.stage,
                graph=StageGraph(
                    BlockGraph(f"stage {sp.stage}", deserialize(sp.exported_program, f"stage {sp.stage} program"))
                ).on(self.device),
                input=spec_from_pb(sp.input),
                output=spec_from_pb(sp.output),
            )
            for sp in request.stages
        ]
        loss = None
        if request.loss_program:
            loss = BlockGraph("loss", on_device(deserialize(request.loss_program, "loss program"), self.device))
        try:
            actions = [Action.from_pb(a) for a in request.actions]
            recv_slots = {Action.from_pb(s.action): s.slot for s in request.recv_slots}
            routes = Routes(Dataflow.from_pb(request.num_stages, request.edges, request.tied), request.stage_ranks)
            _check_plan(routes, request)
        except ValueError as e:
            raise InvalidInput(str(e)) from None
        config = JobConfig.from_pb(request.config)
        timeout_s = config.data_plane_timeout_s
        try:
            executor = PipelineExecutor(
                rank=request.rank,
                stages=stages,
                loss=loss,
                routes=routes,
                microbatches=config.microbatches,
                actions=actions,
                recv_slots=recv_slots,
                optimizer=config.optimizer,
                optimizer_args=config.optimizer_args,
                rematerialize=config.rematerialize,
                transport=None,
                timeout_s=timeout_s,
                device=self.device,
                replica=request.replica,
                replicas=config.data_parallel,
                zero=config.zero == 1,
            )
            if request.world_size > 1:
                executor.transport = self._connect(request, executor, timeout_s)
            try:
                if config.data_parallel > 1:
                    executor.use_replicas(
                        self._cpu_group(
                            request.replica_group_prefix,
                            request.replica,
                            config.data_parallel,
                            request,
                            timeout_s,
                            "data parallelism",
                        )
                    )
                executor.island_rank, executor.island_size = request.tp_rank, config.tensor_parallel
                if config.tensor_parallel > 1:
                    executor.island = self._cpu_group(
                        request.tp_group_prefix,
                        request.tp_rank,
                        config.tensor_parallel,
                        request,
                        timeout_s,
                        "tensor parallelism",
                    )
            except Exception:
                executor.close()  # the groups joined just before
                raise
        except DataPlaneError as e:
            raise JobFailed(str(e)) from None
        with self._lock:
            self._jobs[request.job_id] = executor
        log.info("loaded job %s as rank %d (%d actions)", request.job_id, request.rank, len(actions))
        return pb.LoadPlanReply(parameter_bytes=executor.parameter_bytes)

    def _store(self, request: pb.LoadPlanRequest, prefix: str, timeout_s: float) -> ControllerStore:
        """The job's rendezvous namespace (at the controller, behind its token and the plan's secret)."""
        if self.controller is None:
            raise DataPlaneError("this worker has no controller to meet its peers through")
        return ControllerStore(self.controller, request.store_namespace, request.store_secret, prefix, timeout_s)

    def _cpu_group(
        self, prefix: str, rank: int, size: int, request: pb.LoadPlanRequest, timeout_s: float, what: str
    ) -> GlooTransport:
        """A gloo group of this worker with its peers: across the data-parallel replicas (gradient
        average) or across its stage's island (tensor-parallel collectives)."""
        if self.device.type != "cpu":
            raise DataPlaneError(f"{what} runs on CPU workers only (not built for CUDA yet)")
        if not 0 <= rank < size:
            raise InvalidInput(f"{what}: rank {rank} is not one of 0..{size - 1}")
        store = self._store(request, prefix, timeout_s)
        return GlooTransport(store=store, rank=rank, world_size=size, hostname=self.host, timeout_s=timeout_s)

    def _connect(self, request: pb.LoadPlanRequest, executor: PipelineExecutor, timeout_s: float) -> PeerTransports:
        """The transports the plan names for this rank's edges, one per peer rank.

        gloo and NCCL are process groups, joined by all ranks or none: every rank joins those the
        plan lists in ``groups`` (any edge of the job uses them), even with no edge of its own on
        them. CUDA IPC is set up only between the ranks whose edges use it."""
        peers = {p: name for p, name in enumerate(request.peer_transports) if name}
        by_name: dict[str, object] = {}
        try:
            job_store = self._store(request, request.store_prefix, timeout_s)
            if "gloo" in request.groups:
                by_name["gloo"] = GlooTransport(
                    store=job_store,
                    rank=request.rank,
                    world_size=request.world_size,
                    hostname=self.host,
                    timeout_s=timeout_s,
                )
            if "nccl" in request.groups:
                by_name["nccl"] = NcclTransport(
                    store=job_store, rank=request.rank, world_size=request.world_size, timeout_s=timeout_s
                )
            ipc_peers = [p for p, name in peers.items() if name == "cuda_ipc"]
            if ipc_peers:
                if self.device.type != "cuda":
                    raise DataPlaneError(f"the plan asks for cuda_ipc on a {self.device} worker")
                by_name["cuda_ipc"] = CudaIpcTransport(
                    store=job_store,
                    rank=request.rank,
                    peers=ipc_peers,
                    region=executor.recv_region,
                    buffers=executor.recv_buffers,
                    timeout_s=timeout_s,
                )
            unknown = sorted({n for n in peers.values()} - set(by_name))
            if unknown:
                raise DataPlaneError(f"the plan names transports this worker does not have: {unknown}")
        except Exception:
            for transport in by_name.values():
                transport.close()
            raise
        return PeerTransports({p: by_name[name] for p, name in peers.items()}, list(by_name.values()))

    def _step_in_turn(self, request: pb.RunStepRequest) -> pb.RunStepReply:
        with self.turnstile.turn(request.gang_seq, request.gang_floor):
            return self._step(request)

    @rpc_handler
    @controller_only
    def RunStep(self, request: pb.RunStepRequest, context):
        return self._step_in_turn(request)

    @rpc_handler
    @controller_only
    def RunStepGroup(self, request: pb.RunStepGroupRequest, context):
        """This worker's part of a step, and the other members' relayed to them (runtime/net/relay.py)."""
        return self.relay.run(request)

    @rpc_stream_handler
    @controller_only
    def RunStepStream(self, request: pb.RunStepRequest, context):
        """RunStep that first reports when its turn has come (sequential dispatch waits for it)."""
        with self.turnstile.turn(request.gang_seq, request.gang_floor):
            yield pb.RunStepEvent(started=True)
            reply = self._step(request)
        yield pb.RunStepEvent(reply=reply)

    @_log.in_context(lambda request: (request.job_id, request.step))
    def _step(self, request: pb.RunStepRequest) -> pb.RunStepReply:
        """Run one step of a loaded job; call in the request's turn."""
        control_bytes = sum(len(t.data) for t in (*request.inputs, *request.targets))
        executor = self._job(request.job_id)
        self._use_device()
        try:
            pulled_inputs = [self._pull(r, executor.timeout_s) for r in request.input_refs]
            pulled_targets = [self._pull(r, executor.timeout_s) for r in request.target_refs]
            pulled = sum(t.nbytes for t in (*pulled_inputs, *pulled_targets))
            sent_inputs = [tensor_from_pb(t, "input") for t in request.inputs]
            sent_targets = [tensor_from_pb(t, "target") for t in request.targets]
            inputs = interleave(sent_inputs, pulled_inputs, request.input_ref_at) or None
            targets = interleave(sent_targets, pulled_targets, request.target_ref_at) or None
            losses, memory, outputs = executor.run_step(inputs, targets, request.mode or "train", request.step)
        except Exception as e:
            raise JobFailed(f"job {request.job_id} step {request.step}: {e}") from None
        memory["data_plane_bytes"]["received"] += pulled
        memory["control_plane_tensor_bytes"] = control_bytes
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

    def _pull(self, ref: pb.RemoteRef, timeout_s: float) -> torch.Tensor:
        """A remote value, from this worker's store or straight from its holder (never via the controller)."""
        if ref.address == self.values.address:
            return self.values.get(ref.value_id)
        return pull(ref.address, self._token, ref.value_id, timeout_s)

    @rpc_handler
    @controller_only
    def PutValue(self, request: pb.PutValueRequest, context):
        self.values.put(request.value_id, tensor_from_pb(request.tensor, "value"))
        return pb.Empty()

    @rpc_handler
    def GetValue(self, request: pb.RemoteRef, context):
        return tensor_to_pb(self.values.get(request.value_id))

    @rpc_handler
    @controller_only
    def FreeValue(self, request: pb.RemoteRef, context):
        self.values.free(request.value_id)
        return pb.Empty()

    @rpc_handler
    @controller_only
    def GetState(self, request: pb.GetStateRequest, context):
        with self.turnstile.turn(request.gang_seq, request.gang_floor):
            # serialized inside the turn: a queued step must not update weights mid-read
            state = self._job(request.job_id).state_dict()
            return pb.StateReply(tensors=[pb.NamedTensor(name=k, tensor=tensor_to_pb(v)) for k, v in state.items()])

    @rpc_handler
    @controller_only
    def SaveState(self, request: pb.SaveStateRequest, context):
        """Write this worker's tensors of the job into a checkpoint version (atoll.core.checkpoint)."""
        with self.turnstile.turn(request.gang_seq, request.gang_floor):
            tensors = self._job(request.job_id).checkpoint_tensors()
            if "/" in request.file or request.file.startswith("."):
                raise InvalidInput(f"checkpoint file name {request.file!r} must be a plain name")
            keys = checkpoint.write_tensors(Path(request.directory), request.file, tensors)
            return pb.SaveStateReply(keys_json=json.dumps(keys))

    @rpc_handler
    @controller_only
    def LoadState(self, request: pb.LoadStateRequest, context):
        """Load the job's weights and optimizer state from a committed checkpoint version, cut for
        this worker's place in the job's layout."""
        with self.turnstile.turn(request.gang_seq, request.gang_floor):
            executor = self._job(request.job_id)
            version = Path(request.directory)
            try:
                manifest = json.loads((version / checkpoint.MANIFEST).read_text())
                cuts = {name: ParamShard.from_json(c) for name, c in json.loads(request.cuts_json or "{}").items()}
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
        if executor is None:
            raise NotFound(f"job {request.job_id!r} is not loaded on this worker")
        executor.close()
        return pb.Empty()

    @rpc_stream_handler
    def Chunked(self, request_iterator, context):
        yield from chunked.serve(self, "Worker", request_iterator, context)

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


class WorkerDaemon:
    """Serves the Worker service and keeps itself registered with the controller."""

    def __init__(
        self,
        *,
        controller: str,
        token: str,
        device: str = "cpu",
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        island: str = "",
        allow_pickle: bool = False,
        register_timeout_s: float = 30.0,
    ):
        check_device(device)
        self.register_timeout_s = register_timeout_s
        """How long ``start`` keeps trying while no controller answers."""
        forbid_pickle(allow_pickle)
        self.controller_address = _address.checked(controller, "controller address")
        self.service = WorkerService(device=device, host=advertise_host or host, token=token, bind_host=host)
        self.server, self.port = make_server(token, host, port)
        pb_grpc.add_WorkerServicer_to_server(self.service, self.server)
        self.health = Health(self.server, "atoll.v1.Worker")
        """grpc.health.v1: SERVING while registered and its heartbeats reach the controller."""
        self._token = token
        self.address = _address.join(advertise_host or host, self.port)
        self.device = device
        self.island = island
        self._controller = Endpoint(controller, token, pb_grpc.ControllerStub, default_timeout_s=10.0)
        self.service.controller = self._controller
        self._stop = threading.Event()
        self.worker_id = ""
        self._interval = 1.0

    def _register(self) -> None:
        gpu_uuid = ""
        if self.device.startswith("cuda"):
            gpu_uuid = str(torch.cuda.get_device_properties(torch.device(self.device)).uuid)
        reply = self._controller.call(
            "RegisterWorker",
            pb.RegisterWorkerRequest(
                address=self.address,
                device=self.device,
                host=socket.gethostname(),
                pid=os.getpid(),
                gpu_uuid=gpu_uuid,
                island=self.island,
                value_address=self.service.values.address,
            ),
        )
        if self.worker_id:  # registering again: the controller restarted or declared us dead
            log.warning("registering again as %s; dropping the jobs of %s", reply.worker_id, self.worker_id)
            self.service.drop_all_jobs()
        self.worker_id = reply.worker_id
        self.service.controller_key = reply.controller_key
        self.service.relay.use_controller_key(reply.controller_key)
        self.service.turnstile.reset()  # the controller numbers a new registration's work from 1
        self._interval = reply.heartbeat_interval_s or 1.0
        _log.set_worker(self.worker_id)
        self.health.set(True)
        log.info("registered as %s at %s", self.worker_id, self.address)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                if not self.worker_id:
                    self._register()
                    continue
                beat = pb.HeartbeatRequest(worker_id=self.worker_id, rss_bytes=rss_bytes())
                reply = self._controller.call("Heartbeat", beat, timeout_s=5.0)
                if not reply.known:
                    log.warning("controller does not know %s; registering again", self.worker_id)
                    self.health.set(False)
                    self._register()
                self.health.set(True)
            except AtollError as e:
                self.health.set(False)
                log.warning("heartbeat to %s failed: %s", self.controller_address, e)

    # How often a worker waiting for its controller says so (it retries every RETRY_S meanwhile).
    RETRY_S, WARN_EVERY_S = 0.5, 5.0

    def start(self) -> None:
        """Register with the controller, retrying for ``register_timeout_s`` while none answers (it
        may be starting too). An answer that will not change (a wrong token, a refused
        registration) ends the wait at once."""
        register_timeout_s = self.register_timeout_s
        self.server.start()
        started = time.monotonic()
        warned = -self.WARN_EVERY_S
        while True:
            try:
                self._register()
                break
            except Unauthenticated as e:
                raise Unauthenticated(
                    f"the controller at {self.controller_address} refused this worker's token "
                    f"(--token-file, $ATOLL_TOKEN): {e}"
                ) from None
            except (WorkerUnavailable, DeadlineExceeded) as e:
                waited = time.monotonic() - started
                if waited > register_timeout_s:
                    raise WorkerUnavailable(
                        f"no controller answered at {self.controller_address} in {register_timeout_s:g} s "
                        f"(is it running, and is the address right?): {e}"
                    ) from None
                if waited - warned >= self.WARN_EVERY_S:
                    warned = waited
                    log.warning(
                        "no controller answers at %s yet; retrying for up to %g s",
                        self.controller_address,
                        register_timeout_s,
                    )
                time.sleep(self.RETRY_S)
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()

    def _deregister(self, timeout_s: float = 2.0) -> None:
        """Leave the controller at once (not after its heartbeat timeout); its call carries the
        key the controller gave at registration, which only its workers hold."""
        if not self.worker_id or not self.service.controller_key:
            return
        endpoint = Endpoint(
            self.controller_address,
            self._token,
            pb_grpc.ControllerStub,
            default_timeout_s=timeout_s,
            controller_key=self.service.controller_key,
        )
        try:
            endpoint.call("DeregisterWorker", pb.WorkerRef(worker_id=self.worker_id))
            log.info("deregistered %s", self.worker_id)
        except AtollError as e:  # the controller may be gone or stopping too
            log.info("could not deregister %s: %s", self.worker_id, e)
        finally:
            endpoint.close()

    def stop(self) -> None:
        self._stop.set()
        self.health.shutdown()
        self._deregister()
        self.server.stop(grace=1.0).wait(5.0)
        self.service.values.close()
        self.service.relay.close()
        self._controller.close()
