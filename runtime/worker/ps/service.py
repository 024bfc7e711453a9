"""The ParameterServer gRPC service of a worker: the roles it plays in parameter-server jobs.

A worker is a server (it holds replicas of some shards) or a task of a job. The controller loads,
reconfigures (after a death) and unloads; tasks pull and push; a push is chain-replicated: the
shard's head applies it and passes it to the next server of the chain, which does the same, and
each answers only once the rest of the chain has, so the task's acknowledgement means every
replica applied it. Clients feed tasks with ``Step`` straight, not through the controller. Every
call carries the cluster token; the controller's also carry its key.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from atoll._rpc import atoll_pb2 as pb
from atoll._rpc import atoll_pb2_grpc as pb_grpc
from atoll.core.ps_layout import Key
from atoll.core.ps_rules import Consistency, UpdateRule
from atoll.core.wire import tensor_from_pb, tensor_to_pb
from atoll.errors import DeadlineExceeded, InvalidInput, NotFound
from atoll.net.rpc import rpc_handler
from atoll.net.shard_peers import ShardPeers
from atoll.worker.ps.shard import Push, ShardReplica
from atoll.worker.ps.task import Task
from atoll.worker.service import controller_only


def keys_from_pb(layout: pb.PsLayout) -> list[Key]:
    return [Key(k.key, k.param, k.row_start, k.row_end, k.shard, k.sparse) for k in layout.keys]


def _rules(config: pb.PsConfig) -> tuple[UpdateRule, Consistency]:
    return (
        UpdateRule(config.optimizer, config.lr, config.weight_decay),
        Consistency(config.consistency, config.max_delay, config.wait_timeout_s),
    )


def _named(messages, what: str) -> dict:
    return {m.name: tensor_from_pb(m.tensor, f"{what} {m.name}") for m in messages}


@dataclass(eq=False)
class _ServerRole:
    index: int
    config: pb.PsConfig
    keys: list[Key]
    peers: ShardPeers
    shards: dict[int, ShardReplica] = field(default_factory=dict)
    adopting: dict[int, threading.Event] = field(default_factory=dict)

    def replica(self, shard: int) -> ShardReplica:
        if shard not in self.shards and shard in self.adopting:  # a copy on its way (Adopt)
            if not self.adopting[shard].wait(30.0):
                raise DeadlineExceeded(f"shard {shard}: its copy did not arrive on server {self.index} in 30s")
        replica = self.shards.get(shard)
        if replica is None:
            raise NotFound(f"job {self.config.job_id}: server {self.index} holds no replica of shard {shard}")
        return replica

    def new_replica(self, shard: int, values: dict) -> ShardReplica:
        rule, consistency = _rules(self.config)
        keys = [k for k in self.keys if k.shard == shard]
        return ShardReplica(keys, values, rule, consistency, self.config.tasks)


class ParameterServerService(pb_grpc.ParameterServerServicer):
    def __init__(self, worker, token: str):
        self._worker = worker
        """The worker's main service: the controller's key it registered with."""
        self._token = token
        self._servers: dict[str, _ServerRole] = {}
        self._tasks: dict[str, Task] = {}

    @property
    def controller_key(self) -> str:
        """The key of the controller the worker registered with (``controller_only`` checks it)."""
        return self._worker.controller_key

    def _server(self, job_id: str) -> _ServerRole:
        role = self._servers.get(job_id)
        if role is None:
            raise NotFound(f"parameter-server job {job_id!r} has no server on this worker")
        return role

    @rpc_handler
    @controller_only
    def Load(self, request, context):
        config = request.config
        keys = keys_from_pb(config.layout)
        _rules(config)  # a bad optimizer or consistency is refused before anything is kept
        if request.role == "server":
            chains = [list(c.servers) for c in config.layout.chains]
            peers = ShardPeers(list(config.layout.servers), chains, self._token, config.wait_timeout_s + 30.0)
            role = _ServerRole(request.index, config, keys, peers)
            values = _named(request.values, "initial value of")
            for shard, chain in enumerate(chains):
                if request.index in chain:
                    role.shards[shard] = role.new_replica(shard, values)
            self._servers[config.job_id] = role
        elif request.role == "task":
            self._tasks[config.job_id] = Task(config, request.index, request.graph, self._token, keys)
        else:
            raise InvalidInput(f"role {request.role!r}: a worker of a parameter-server job is a server or a task")
        return pb.Empty()

    @rpc_handler
    def Pull(self, request, context):
        replica = self._server(request.job_id).replica(request.shard)
        rows = [(r.key, tensor_from_pb(r.rows, f"rows of {r.key}")) for r in request.rows]
        values, clock, staleness, waited = replica.pull(
            request.task, request.iteration, list(request.keys), rows, request.no_wait
        )
        names = [*request.keys, *(r.key for r in request.rows)]
        return pb.PsPullReply(
            values=[pb.NamedTensor(name=n, tensor=tensor_to_pb(v)) for n, v in zip(names, values)],
            clock=clock,
            staleness=staleness,
            waited_s=waited,
        )

    @rpc_handler
    def Push(self, request, context):
        role = self._server(request.job_id)
        replica = role.replica(request.shard)
        grads = _named(request.row_grads, "gradient of rows of")
        if len(grads) != len(request.rows):
            raise InvalidInput("a push names rows and their gradients in pairs")
        push = Push(
            _named(request.grads, "gradient of"),
            {r.key: (tensor_from_pb(r.rows, f"rows of {r.key}"), grads.get(r.key)) for r in request.rows},
        )
        if any(g is None for _, g in push.sparse.values()):
            raise InvalidInput("a push's rows and row gradients must name the same keys")
        replica.check(request.task, push)
        with replica.order:  # one push at a time here, so each replica applies them in the head's order
            replica.push(request.task, request.iteration, push)
            role.peers.pass_down(request.shard, role.index, "Push", request)
        return pb.Empty()

    @rpc_handler
    def Step(self, request, context):
        task = self._tasks.get(request.job_id)
        if task is None:
            raise NotFound(f"parameter-server job {request.job_id!r} has no task on this worker")
        if request.task != task.index:
            raise InvalidInput(f"this worker runs task {task.index} of job {request.job_id}, not task {request.task}")
        tensors = [tensor_from_pb(t, f"input {i}") for i, t in enumerate(request.inputs)]
        tensors.append(tensor_from_pb(request.target, "target"))
        return task.step(tensors, request.emulated_compute_s)

    @rpc_handler
    @controller_only
    def Reconfigure(self, request, context):
        chains = [list(c.servers) for c in request.chains]
        if request.job_id in self._tasks:
            self._tasks[request.job_id].peers.reconfigure(chains)
        role = self._servers.get(request.job_id)
        if role is not None:
            role.peers.reconfigure(chains)
            for replica in role.shards.values():
                for task in request.dropped_tasks:
                    replica.drop(task)
        return pb.Empty()

    @rpc_handler
    def Export(self, request, context):
        """A copy of this server's replica of a shard (the chain's tail), for ``joiner`` to hold from
        now on: it joins the chain after this server in the same breath, so every push this
        server applies after the copy is passed down to it."""
        role = self._server(request.job_id)
        replica = role.replica(request.shard)
        with replica.order:
            values, clock, pending = replica.export()
            role.peers.join(request.shard, request.joiner)
        named = lambda d: [pb.NamedTensor(name=n, tensor=tensor_to_pb(t)) for n, t in d.items()]  # noqa: E731
        return pb.PsShardState(values=named(values), clock=clock, pending=named(pending))

    @rpc_handler
    @controller_only
    def Adopt(self, request, context):
        """Become a replica of a shard, copied from its chain's tail (re-replication after a death)."""
        role = self._server(request.job_id)
        arrived = role.adopting.setdefault(request.shard, threading.Event())
        try:
            export = pb.PsExportRequest(job_id=request.job_id, shard=request.shard, joiner=role.index)
            state = role.peers.call(request.shard, "Export", export, members=[request.source])
            values = _named(state.values, "state of")
            replica = role.new_replica(request.shard, values)
            replica.restore(values, list(state.clock), _named(state.pending, "pending"))
            role.shards[request.shard] = replica
        finally:
            arrived.set()
            role.adopting.pop(request.shard, None)
        return pb.Empty()

    @rpc_handler
    @controller_only
    def Unload(self, request, context):
        self._drop(request.job_id)
        return pb.Empty()

    def _drop(self, job_id: str) -> None:
        self._servers.pop(job_id, None)
        self._tasks.pop(job_id, None)

    def held_jobs(self) -> list[pb.HeldJob]:
        """The jobs this worker serves a role in (sent when registering again, as pipeline jobs are)."""
        return [pb.HeldJob(job_id=j, namespace="parameter-server") for j in sorted({*self._servers, *self._tasks})]

    def keep_only(self, job_ids: set[str]) -> None:
        """Drop every role but those of ``job_ids``: the controller does not know the others (it
        restarted without their records), so nobody could close them."""
        for job_id in {*self._servers, *self._tasks} - job_ids:
            self._drop(job_id)
