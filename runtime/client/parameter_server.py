"""Parameter-server jobs from the client: export, submit, feed each task straight, read weights.

    job = client.parameter_server(model, example_input=x, example_target=y, loss_fn=loss,
                                  servers=2, workers=4, consistency="bounded", max_delay=2,
                                  optimizer="adamw", lr=1e-3, replication=2)
    record = job.step_task(0, x0, y0)          # task 0's next iteration, on its worker
    records = job.run([loader0, loader1, ...])  # every task fed from its own iterable, in parallel
    job.weights()                              # the servers' current values

The model and loss are exported once as one graph with the weights left out (the servers hold
them); batches go from here to each task's worker, never through the controller.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from atoll._rpc import atoll_pb2 as pb
from atoll._rpc import atoll_pb2_grpc as pb_grpc
from atoll.client.export import as_leaves
from atoll.core import ps_layout
from atoll.core.graphs import leave_out_values, serialize
from atoll.core.ps_rules import Consistency, UpdateRule
from atoll.core.wire import tensor_from_pb, tensor_spec_from_pb, tensor_to_pb
from atoll.errors import AtollError, InvalidInput, NotFound, WorkerUnavailable
from atoll.net.rpc import Endpoint
from atoll.net.shard_peers import ShardPeers

PREFIX = "model."
"""The exported graph holds the model under this name; users see the model's own names."""


class _Train(nn.Module):
    def __init__(self, model: nn.Module, loss_fn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args):
        *inputs, target = args
        return self.loss_fn(self.model(*inputs), target)


@dataclass(frozen=True, slots=True)
class TaskStep:
    """One task's iteration as it ran: what it trained with and what it moved."""

    task: int
    iteration: int
    loss: float
    staleness: int
    """Iterations of some task's updates missing from the values it pulled (0: none)."""
    waited_s: float
    bytes_pulled: int
    bytes_pushed: int
    versions: tuple[int, ...]
    """Per shard, the version of the values pulled: the sum of its vector clock (-1: not read)."""


def _sparse_params(ep: torch.export.ExportedProgram) -> list[str]:
    """Parameters the graph reads only as embedding tables (``aten.embedding``'s first argument)."""
    of_placeholder = ep.graph_signature.inputs_to_parameters
    found = []
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in of_placeholder and node.users:
            if all(u.target is torch.ops.aten.embedding.default and u.args[0] is node for u in node.users):
                found.append(of_placeholder[node.name])
    return found


def export_training(model: nn.Module, example_input, example_target, loss_fn):
    """(graph without weights, {parameter: initial value}, sparse parameters)."""
    if not isinstance(model, nn.Module):
        raise InvalidInput(f"model must be an nn.Module, got {type(model).__name__}")
    inputs = as_leaves(example_input, "example_input")
    args = (*inputs, *as_leaves(example_target, "example_target"))
    if len(args) != len(inputs) + 1:
        raise InvalidInput("example_target must be one tensor")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = torch.export.export(_Train(model, loss_fn), args)
    except Exception as e:
        raise InvalidInput(f"torch.export failed for the model and loss: {type(e).__name__}: {e}") from None
    values = {name: ep.state_dict[name].detach().clone() for name in ep.graph_signature.parameters}
    leave_out_values(ep, values)  # the servers hold the values
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = serialize(ep)
    return graph, values, _sparse_params(ep)


class ParameterServerJob:
    def __init__(self, client, reply: pb.PsJobReply, inputs: int):
        self.client = client
        self.job_id = reply.job_id
        self.layout = reply.layout
        self.keys = [
            ps_layout.Key(k.key, k.param, k.row_start, k.row_end, k.shard, k.sparse) for k in reply.layout.keys
        ]
        self.tasks = len(reply.task_addresses)
        self.task_worker_ids = list(reply.task_worker_ids)
        self.server_worker_ids = list(reply.server_worker_ids)
        self._inputs = inputs
        token, tls = client._token, client._tls
        self._tasks = [
            Endpoint(a, token, pb_grpc.ParameterServerStub, client.step_timeout_s, tls=tls)
            for a in reply.task_addresses
        ]
        chains = [list(c.servers) for c in reply.layout.chains]
        self._servers = ShardPeers(list(reply.layout.servers), chains, token, 60.0)
        self.records: list[TaskStep] = []
        """Every task step this client ran, in the order they ended."""
        self.errors: dict[int, AtollError] = {}
        """Per task that ``run`` stopped feeding, why."""
        self._lock = threading.Lock()

    def step_task(self, task: int, *batch: torch.Tensor, emulated_compute_s: float = 0.0) -> TaskStep:
        """Task ``task``'s next iteration on ``batch`` (its inputs, then the target): pull, forward,
        backward, push. Blocks while the job's consistency makes the task wait for slower ones.
        ``emulated_compute_s`` (benchmarks) holds the step that long after its pull, as a device's
        compute time would, without using a CPU core."""
        if isinstance(task, bool) or not isinstance(task, int) or not 0 <= task < self.tasks:
            raise InvalidInput(f"task {task!r} is out of range: job {self.job_id} has tasks 0..{self.tasks - 1}")
        if len(batch) != self._inputs + 1:
            raise InvalidInput(f"step_task takes {self._inputs} input(s) and the target, got {len(batch)} tensors")
        *inputs, target = batch
        request = pb.PsStepRequest(
            job_id=self.job_id,
            task=task,
            inputs=[tensor_to_pb(t) for t in inputs],
            target=tensor_to_pb(target),
            emulated_compute_s=emulated_compute_s,
        )
        reply = self._tasks[task].call("Step", request)
        record = TaskStep(
            task,
            reply.iteration,
            reply.loss,
            reply.staleness,
            reply.waited_s,
            reply.bytes_pulled,
            reply.bytes_pushed,
            tuple(reply.versions),
        )
        with self._lock:
            self.records.append(record)
        return record

    def run(self, feeds: Sequence[Iterable]) -> list[TaskStep]:
        """Feed every task from its own iterable of batches (tuples: inputs, then the target), each
        in its own thread, until its iterable ends. A task whose worker fails stops (its error in
        ``errors``); the others go on. The records of this run, in the order they ended."""
        if len(feeds) != self.tasks:
            raise InvalidInput(f"run takes one iterable per task ({self.tasks}), got {len(feeds)}")
        start = len(self.records)

        def feed(task: int, batches: Iterable) -> None:
            try:
                for batch in batches:
                    self.step_task(task, *batch)
            except AtollError as e:
                self.errors[task] = e

        threads = [threading.Thread(target=feed, args=(t, f), daemon=True) for t, f in enumerate(feeds)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return self.records[start:]

    def weights(self) -> dict[str, torch.Tensor]:
        """Every parameter's current value, read from the servers (no waiting for any task)."""
        parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for shard in range(len(self.layout.chains)):
            keys = [k for k in self.keys if k.shard == shard]
            if not keys:
                continue
            request = pb.PsPullRequest(job_id=self.job_id, shard=shard, no_wait=True)
            for k in keys:
                if k.sparse:
                    request.rows.add(key=k.key, rows=tensor_to_pb(torch.arange(k.row_start, k.row_end)))
                else:
                    request.keys.append(k.key)
            # its chain as this client last heard it, then any other server: after a death the
            # controller copies a shard to a server this client does not know holds it
            chain = self._servers.chain(shard)
            others = [s for s in range(len(self.layout.servers)) if s not in chain]
            reply = self._servers.call(shard, "Pull", request, chain + others, skip=(WorkerUnavailable, NotFound))
            order = [k for k in keys if not k.sparse] + [k for k in keys if k.sparse]
            for k, v in zip(order, reply.values):
                parts.setdefault(k.param, []).append((k.row_start, tensor_from_pb(v.tensor, k.key)))
        return {
            name.removeprefix(PREFIX): (
                p[0][1] if len(p) == 1 else torch.cat([t for _, t in sorted(p, key=lambda x: x[0])])
            )
            for name, p in parts.items()
        }

    def predicted_step_bytes(self, touched: dict[str, torch.Tensor] | None = None) -> tuple[int, int]:
        """(pulled, pushed) payload bytes of one task step whose batch reads, for each sparse
        parameter (the model's name), the rows in ``touched``."""
        row_bytes = {}
        for name, msg in zip(self.layout.param_names, self.layout.params):
            spec = tensor_spec_from_pb(msg, name)
            row_bytes[name] = spec.nbytes // (spec.shape[0] if spec.shape else 1)
        rows = {PREFIX + n: sorted(set(t.flatten().tolist())) for n, t in (touched or {}).items()}
        return ps_layout.step_bytes(self.keys, row_bytes, rows)

    def close(self) -> None:
        self.client._call("CloseJob", pb.JobRef(job_id=self.job_id))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def submit(
    client,
    model: nn.Module,
    example_input,
    example_target,
    loss_fn,
    *,
    servers: int,
    workers: int,
    consistency: str = "sequential",
    max_delay: int = 0,
    optimizer: str = "sgd",
    lr: float = 0.01,
    weight_decay: float = 0.0,
    replication: int = 1,
    rows_per_key: int = 65536,
    wait_timeout_s: float = 60.0,
    sparse: bool = True,
) -> ParameterServerJob:
    UpdateRule(optimizer, lr, weight_decay)  # refused here, before anything is exported
    Consistency(consistency, max_delay, wait_timeout_s)
    for what, n in (("servers", servers), ("workers", workers), ("replication", replication)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidInput(f"{what} must be a positive integer, got {n!r}")
    graph, values, sparse_params = export_training(model, example_input, example_target, loss_fn)
    config = pb.PsConfig(
        consistency=consistency,
        max_delay=max_delay,
        tasks=workers,
        optimizer=optimizer,
        lr=lr,
        weight_decay=weight_decay,
        wait_timeout_s=wait_timeout_s,
    )
    request = pb.PsProgram(
        config=config,
        graph=graph,
        values=[pb.NamedTensor(name=n, tensor=tensor_to_pb(v)) for n, v in values.items()],
        servers=servers,
        replication=replication,
        rows_per_key=rows_per_key,
        session=client.session,
        sparse_params=sparse_params if sparse else [],
    )
    client._keep_alive()  # the job lives while this client renews its session's lease
    reply = client._call("SubmitParameterServer", request, timeout_s=600.0)
    return ParameterServerJob(client, reply, len(as_leaves(example_input, "example_input")))
