"""Plan loading: turns one LoadPlan request into a running executor, its transports joined.

Workers interpret, they do not decide: everything they run arrives in a plan compiled by the
controller. Stage programs arrive as exported graphs and load with pickle refused.
"""

from __future__ import annotations

import torch

from atoll._rpc import atoll_pb2 as pb
from atoll.core.actions import Action
from atoll.core.config import WorkerSettings
from atoll.core.dataflow import Dataflow, Routes
from atoll.core.graphs import BlockGraph, StageGraph, deserialize, on_device
from atoll.core.mesh import WorkerMesh
from atoll.core.wire import spec_from_pb
from atoll.errors import InvalidInput, JobFailed
from atoll.net.rpc import Endpoint
from atoll.worker.executor.interpreter import PipelineExecutor, StageSetup
from atoll.worker.rendezvous import ControllerStore
from atoll.worker.transports.cuda_ipc import CudaIpcTransport
from atoll.worker.transports.gloo import DataPlaneError, GlooTransport, PeerTransports
from atoll.worker.transports.nccl import NcclTransport
from atoll.worker.transports.socket_ring import SocketRing
from atoll.worker.transports.sockets import SocketTransport


def _check_plan(routes: Routes, request: pb.LoadPlanRequest, ranks: int) -> None:
    """Refuse a plan whose graph does not fit together (ValueError), before anything is built."""
    n = request.num_stages
    if len(request.stage_ranks) != n or any(not 0 <= r < ranks for r in request.stage_ranks):
        raise ValueError(f"stage_ranks {list(request.stage_ranks)} do not place {n} stages on {ranks} ranks")
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


def _share_base(stages: list[StageSetup], base: PipelineExecutor) -> frozenset[int]:
    """Make each frozen parameter of the job's stages the base's tensor of the same name and stage
    on this worker, dropping the job's own copy (the base's values are what it trains on, whatever
    the client sent); the ids of the shared parameters. InvalidInput where the base has none."""
    shared = set()
    for setup in stages:
        held = base.stages.get(setup.index)
        theirs = dict(held.graph.named_parameters()) if held is not None else {}
        program = setup.graph.program
        for name, p in list(program.module.named_parameters(remove_duplicate=False)):
            if p.requires_grad:
                continue
            mine = theirs.get(name)
            if mine is None or mine.shape != p.shape or mine.dtype != p.dtype:
                found = "holds no such parameter" if mine is None else f"holds it as {mine.dtype} {list(mine.shape)}"
                raise InvalidInput(
                    f"stage {setup.index}: frozen parameter {name} ({p.dtype} {list(p.shape)}) is not the "
                    f"base's: the base's stage {setup.index} on this worker {found}"
                )
            owner, _, attr = name.rpartition(".")
            program.module.get_submodule(owner)._parameters[attr] = mine
            if name in program.ep.state_dict:  # the archive's copy would keep the client's values alive
                program.ep.state_dict[name] = mine
            shared.add(id(mine))
    return frozenset(shared)


class PlanLoader:
    """Builds the executor of one plan on this worker's device.

    ``controller`` is read at load time, not kept from the worker's start: the worker learns it
    only when it registers, and the data plane's rendezvous is there."""

    def __init__(self, *, device: torch.device, host: str, controller: Endpoint | None):
        self.device = device
        self.host = host
        """The address peers reach this worker at (data plane)."""
        self.controller = controller

    def load(self, request: pb.LoadPlanRequest, base: PipelineExecutor | None = None) -> PipelineExecutor:
        """The plan's executor, its transports and process groups joined; InvalidInput for a plan
        that does not fit together, JobFailed when the data plane cannot be set up. ``base``: the
        resident base's executor here, whose parameters the job's frozen ones become."""
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
        shared = _share_base(stages, base) if base is not None else frozenset()
        loss = None
        if request.loss_program:
            loss = BlockGraph("loss", on_device(deserialize(request.loss_program, "loss program"), self.device))
        # the layout comes from the plan's mesh alone, the settings from the plan's own
        mesh = WorkerMesh.from_pb(request.mesh)
        settings = WorkerSettings.from_pb(request.settings)
        try:
            actions = [Action.from_pb(a) for a in request.actions]
            recv_slots = {Action.from_pb(s.action): s.slot for s in request.recv_slots}
            routes = Routes(Dataflow.from_pb(request.num_stages, request.edges, request.tied), request.stage_ranks)
            _check_plan(routes, request, mesh.sizes["pipeline"])
        except ValueError as e:
            raise InvalidInput(str(e)) from None
        timeout_s = settings.data_plane_timeout_s
        try:
            executor = PipelineExecutor(
                rank=mesh.coordinates["pipeline"],
                stages=stages,
                loss=loss,
                routes=routes,
                actions=actions,
                recv_slots=recv_slots,
                settings=settings,
                transport=None,
                device=self.device,
                replica=mesh.coordinates["data"],
                replicas=mesh.sizes["data"],
                base=shared,
            )
            if mesh.sizes["pipeline"] > 1:
                executor.transport = self._connect(request, mesh, executor, timeout_s)
            try:
                if mesh.sizes["data"] > 1:
                    executor.use_replicas(self._replica_group(request, mesh, timeout_s))
                executor.island_rank, executor.island_size = mesh.coordinates["tensor"], mesh.sizes["tensor"]
                if mesh.sizes["tensor"] > 1:
                    executor.island = self._gloo_group(request, mesh, "tensor", timeout_s)
            except Exception:
                executor.close()  # the groups joined just before
                raise
        except DataPlaneError as e:
            raise JobFailed(str(e)) from None
        return executor

    def _store(self, request: pb.LoadPlanRequest, prefix: str, timeout_s: float) -> ControllerStore:
        """The job's rendezvous namespace (at the controller, behind its token and the plan's secret)."""
        if self.controller is None:
            raise DataPlaneError("this worker has no controller to meet its peers through")
        return ControllerStore(self.controller, request.store_namespace, request.store_secret, prefix, timeout_s)

    def _gloo_group(self, request: pb.LoadPlanRequest, mesh: WorkerMesh, dim: str, timeout_s: float) -> GlooTransport:
        """A gloo group of this worker with its peers along mesh dimension ``dim``: across the
        data-parallel replicas (gradient average) or across its stage's island (tensor-parallel
        collectives). CUDA workers' collectives go through it too, staged through pinned host
        memory (NCCL cannot pair ranks on one GPU, the only GPU setting run so far)."""
        store = self._store(request, mesh.groups[dim], timeout_s)
        rank, size = mesh.coordinates[dim], mesh.sizes[dim]
        return GlooTransport(store=store, rank=rank, world_size=size, hostname=self.host, timeout_s=timeout_s)

    def _replica_group(self, request: pb.LoadPlanRequest, mesh: WorkerMesh, timeout_s: float):
        """This worker's group across the data-parallel replicas: a ring over sockets for the
        gradient all-reduce where the plan says so (controller/cluster/transports.py), else gloo."""
        if request.replica_transport != "socket":
            return self._gloo_group(request, mesh, "data", timeout_s)
        if self.device.type != "cpu":
            raise DataPlaneError(f"the plan asks for a socket ring between replicas on a {self.device} worker")
        store = self._store(request, mesh.groups["data"], timeout_s)
        rank, size = mesh.coordinates["data"], mesh.sizes["data"]
        return SocketRing(store=store, rank=rank, world_size=size, host=self.host, timeout_s=timeout_s)

    def _connect(
        self, request: pb.LoadPlanRequest, mesh: WorkerMesh, executor: PipelineExecutor, timeout_s: float
    ) -> PeerTransports:
        """The transports the plan names for this rank's edges, one per peer rank.

        gloo and NCCL are process groups, joined by all ranks or none: every rank joins those the
        plan lists in ``groups`` (any edge of the job uses them), even with no edge of its own on
        them. Sockets and CUDA IPC are set up only between the ranks whose edges use them."""
        peers = {p: name for p, name in enumerate(request.peer_transports) if name}
        by_name: dict[str, object] = {}
        rank, ranks = mesh.coordinates["pipeline"], mesh.sizes["pipeline"]
        try:
            job_store = self._store(request, mesh.groups["pipeline"], timeout_s)
            if "gloo" in request.groups:
                by_name["gloo"] = GlooTransport(
                    store=job_store,
                    rank=rank,
                    world_size=ranks,
                    hostname=self.host,
                    timeout_s=timeout_s,
                )
            if "nccl" in request.groups:
                by_name["nccl"] = NcclTransport(store=job_store, rank=rank, world_size=ranks, timeout_s=timeout_s)
            socket_peers = [p for p, name in peers.items() if name == "socket"]
            if socket_peers:
                by_name["socket"] = SocketTransport(
                    store=job_store, rank=rank, peers=socket_peers, host=self.host, timeout_s=timeout_s
                )
            ipc_peers = [p for p, name in peers.items() if name == "cuda_ipc"]
            if ipc_peers:
                if self.device.type != "cuda":
                    raise DataPlaneError(f"the plan asks for cuda_ipc on a {self.device} worker")
                by_name["cuda_ipc"] = CudaIpcTransport(
                    store=job_store,
                    rank=rank,
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
