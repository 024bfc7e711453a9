"""A worker task of a parameter-server job: pull, compute forward and backward on its own batch,
push, at its own pace.

The task holds the job's graph (``loss_fn(model(x), y)``, exported by the client with its weights
left out) and no weights between steps. Each step pulls the dense keys from their shards, and an
embedding table's rows only as the forward reaches the lookup: the lookup node of the graph is
rewritten into ``sparse_lookup``, which pulls the unique rows the batch names and embeds from
them, so the table is never whole on the task. The backward's gradients go back to each shard in
one push (an empty one to a shard the batch did not touch: its vector clock still advances).
"""

from __future__ import annotations

import threading
import time
import warnings

import torch
import torch.nn.functional as F

from atoll._rpc import atoll_pb2 as pb
from atoll.core.graphs import deserialize
from atoll.core.ps_layout import ROW_BYTES, Key
from atoll.core.wire import TensorSpec, tensor_from_pb, tensor_to_pb
from atoll.errors import InvalidInput
from atoll.net.shard_peers import ShardPeers

_CURRENT = threading.local()


def sparse_lookup(param: str, ids: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """What the rewritten graph calls instead of ``embedding(table, ids)``."""
    return _CURRENT.step.lookup(param, ids, padding_idx)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Step:
    """One step's pulls and sparse lookups (the forward reaches them through ``_CURRENT``)."""

    def __init__(self, task: Task):
        self.task = task
        self.rows: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        """(param, unique row numbers, their pulled rows as a leaf) per lookup."""
        self.pulled = 0
        self.staleness = 0
        self.waited_s = 0.0
        self.versions: dict[int, int] = {}

    def pull(self, shard: int, keys: list[str], rows: list[tuple[str, torch.Tensor]]):
        """Start a pull from ``shard`` (gRPC carries it, no thread of ours waits); a function
        that returns its values."""
        task = self.task
        request = pb.PsPullRequest(
            job_id=task.job_id, shard=shard, task=task.index, iteration=task.iteration, keys=keys
        )
        for name, r in rows:
            request.rows.add(key=name, rows=tensor_to_pb(r))
        answer = task.peers.start(shard, "Pull", request)
        return lambda: self._received(shard, answer(), rows)

    def _received(self, shard: int, reply, rows) -> list[torch.Tensor]:
        values = [tensor_from_pb(v.tensor, v.name) for v in reply.values]
        self.pulled += sum(_nbytes(v) for v in values) + ROW_BYTES * sum(r.numel() for _, r in rows)
        self.staleness = max(self.staleness, reply.staleness)
        self.waited_s += reply.waited_s
        self.versions.setdefault(shard, sum(reply.clock))
        return values

    def lookup(self, param: str, ids: torch.Tensor, padding_idx: int) -> torch.Tensor:
        unique, inverse = ids.reshape(-1).unique(return_inverse=True)
        keys = self.task.keys_of[param]
        asks = [(k, unique[(unique >= k.row_start) & (unique < k.row_end)]) for k in keys]
        asks = [(k, r) for k, r in asks if r.numel()]
        by_shard: dict[int, list[tuple[Key, torch.Tensor]]] = {}
        for k, r in asks:
            by_shard.setdefault(k.shard, []).append((k, r))
        pulls = {s: self.pull(s, [], [(k.key, r) for k, r in parts]) for s, parts in by_shard.items()}
        got = {}
        for s, parts in by_shard.items():
            for (k, _), value in zip(parts, pulls[s]()):
                got[k.key] = value
        rows = torch.cat([got[k.key] for k, _ in asks]).requires_grad_(True)
        self.rows.append((param, unique, rows))
        pad = None  # aten's -1 means "no padding row"; F.embedding's -1 would mean the last row
        if padding_idx >= 0:
            hit = (unique == padding_idx).nonzero()
            pad = int(hit[0, 0]) if hit.numel() else None
        return F.embedding(inverse.view(ids.shape), rows, padding_idx=pad)


class Task:
    def __init__(self, config: pb.PsConfig, index: int, graph: bytes, token: str, keys: list[Key]):
        self.job_id, self.index = config.job_id, index
        self.iteration = 0
        self.keys = keys
        self.keys_of: dict[str, list[Key]] = {}
        for k in sorted(keys, key=lambda k: k.row_start):
            self.keys_of.setdefault(k.param, []).append(k)
        layout = config.layout
        self.shards = len(layout.chains)
        self.dense_by_shard = {s: [k for k in keys if k.shard == s and not k.sparse] for s in range(self.shards)}
        """The dense keys each step pulls whole, by shard (none: the shard is read by lookups only)."""
        chains = [list(c.servers) for c in layout.chains]
        # a shard's head that does not answer: wait as long as for a slow task, for the controller
        # to take it out of the chain (a dead worker is declared so after the heartbeat timeout)
        patience = config.wait_timeout_s
        self.peers = ShardPeers(list(layout.servers), chains, token, patience + 30.0, failover_s=patience)
        self._lock = threading.Lock()
        self.module, self.input_specs = self._load(graph)

    def _load(self, graph: bytes):
        ep = deserialize(graph, f"parameter-server job {self.job_id}: the graph")
        user = set(ep.graph_signature.user_inputs)
        specs = [TensorSpec.of(n.meta["val"]) for n in ep.graph.nodes if n.op == "placeholder" and n.name in user]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = ep.module()
        sparse = {k.param for k in self.keys if k.sparse}
        for node in list(module.graph.nodes):
            if node.op != "get_attr" or node.target not in sparse:
                continue
            for use in list(node.users):
                if use.target is not torch.ops.aten.embedding.default or use.args[0] is not node:
                    raise InvalidInput(f"sparse parameter {node.target!r} is read by {use.target}, not only by lookups")
                padding = use.args[2] if len(use.args) > 2 else -1
                with module.graph.inserting_before(use):
                    lookup = module.graph.call_function(sparse_lookup, (node.target, use.args[1], padding))
                use.replace_all_uses_with(lookup)
                module.graph.erase_node(use)
            module.graph.erase_node(node)
            owner, _, name = node.target.rpartition(".")
            delattr(module.get_submodule(owner), name)  # the table lives on the servers only
        module.recompile()
        return module, specs

    def step(self, inputs: list[torch.Tensor], emulated_compute_s: float = 0.0) -> pb.PsStepReply:
        if len(inputs) != len(self.input_specs):
            raise InvalidInput(
                f"task {self.index}: {len(inputs)} tensors given, the graph takes {len(self.input_specs)} "
                "(inputs, then the target)"
            )
        for i, (t, spec) in enumerate(zip(inputs, self.input_specs)):
            if TensorSpec.of(t) != spec:
                raise InvalidInput(f"task {self.index}: tensor {i} is {TensorSpec.of(t)}, the job was built for {spec}")
        if not 0 <= emulated_compute_s <= 60:
            raise InvalidInput(f"emulated_compute_s must be between 0 and 60, got {emulated_compute_s}")
        with self._lock:
            return self._step(inputs, emulated_compute_s)

    def _step(self, inputs: list[torch.Tensor], emulated_compute_s: float) -> pb.PsStepReply:
        step = _Step(self)
        dense = self.dense_by_shard
        pulls = {s: step.pull(s, [k.key for k in ks], []) for s, ks in dense.items() if ks}
        pulled = {k.key: v for s, answer in pulls.items() for k, v in zip(dense[s], answer())}
        params = {}
        for param, ks in self.keys_of.items():
            if not ks[0].sparse:
                parts = [pulled[k.key] for k in ks]
                value = parts[0] if len(parts) == 1 else torch.cat(parts)
                params[param] = value.requires_grad_(True)
        if emulated_compute_s:  # a benchmark's stand-in for device time, after the values are here
            time.sleep(emulated_compute_s)
        _CURRENT.step = step
        try:
            loss = torch.func.functional_call(self.module, params, tuple(inputs))
            if isinstance(loss, (tuple, list)):
                loss = loss[0]
            loss.backward()
        finally:
            _CURRENT.step = None
        pushed = self._push(step, params)
        self.iteration += 1
        return pb.PsStepReply(
            loss=float(loss.detach()),
            iteration=self.iteration - 1,
            staleness=step.staleness,
            waited_s=step.waited_s,
            bytes_pulled=step.pulled,
            bytes_pushed=pushed,
            versions=[step.versions.get(s, -1) for s in range(self.shards)],
        )

    def _push(self, step: _Step, params: dict[str, torch.Tensor]) -> int:
        requests = [
            pb.PsPushRequest(job_id=self.job_id, shard=s, task=self.index, iteration=self.iteration)
            for s in range(self.shards)
        ]
        pushed = 0
        for param, value in params.items():
            grad = value.grad if value.grad is not None else torch.zeros_like(value)
            for k in self.keys_of[param]:
                part = grad if len(self.keys_of[param]) == 1 else grad[k.row_start : k.row_end]
                requests[k.shard].grads.add(name=k.key, tensor=tensor_to_pb(part))
                pushed += _nbytes(part)
        by_param: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for param, unique, rows in step.rows:
            grad = rows.grad if rows.grad is not None else torch.zeros_like(rows)
            by_param.setdefault(param, []).append((unique, grad))
        for param, parts in by_param.items():
            ids = torch.cat([u for u, _ in parts])
            grads = torch.cat([g for _, g in parts])
            unique, where = ids.unique(return_inverse=True)
            total = torch.zeros((unique.numel(), *grads.shape[1:]), dtype=grads.dtype).index_add_(0, where, grads)
            for k in self.keys_of[param]:
                inside = (unique >= k.row_start) & (unique < k.row_end)
                if inside.any():
                    requests[k.shard].rows.add(key=k.key, rows=tensor_to_pb(unique[inside]))
                    requests[k.shard].row_grads.add(name=k.key, tensor=tensor_to_pb(total[inside]))
                    pushed += _nbytes(total[inside]) + ROW_BYTES * int(inside.sum())
        for answer in [self.peers.start(s, "Push", r) for s, r in enumerate(requests)]:
            answer()
        return pushed
