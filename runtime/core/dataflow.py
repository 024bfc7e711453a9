"""The program as a dataflow graph between stages (docs/architecture.md, "The dataflow graph").

A stage is one exported program over flat tensor lists. An **edge** carries some of a producing
stage's outputs (or of the batch input) to some of a consuming stage's inputs, so a residual made
in stage 0 and used in stage 2 is one edge 0 -> 2, sent once. A **tied parameter** lives in
several stages; its gradients are summed across them before the optimizer step.

``Routes`` is the same graph once stages are placed on ranks: which edges cross the network and
which are local hand-offs. The compiler (lowering, simulator, memory plan) and the executor read
these two objects and nothing else about the program's shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from atoll._rpc import atoll_pb2 as pb
from atoll.core.wire import EdgeSpec, TensorSpec, spec_from_pb, spec_to_pb, tensor_spec_from_pb, tensor_spec_to_pb

BATCH = -1
"""The source of an edge that carries the step's input batch (the controller hands each
consuming rank its microbatches)."""


@dataclass(frozen=True, slots=True)
class Edge:
    src: int
    """Producing stage, or BATCH."""
    dst: int
    """Consuming stage."""
    src_indices: tuple[int, ...]
    """Positions in the producer's flat outputs (or in the batch input's tensors)."""
    dst_indices: tuple[int, ...]
    """Positions in the consumer's flat inputs, one per carried tensor."""
    spec: EdgeSpec
    differentiable: tuple[int, ...] = field(init=False, compare=False)
    """Positions (within this edge) of the tensors that carry a gradient back; fixed at construction,
    since the executor reads it on every microbatch."""

    def __post_init__(self):
        object.__setattr__(self, "differentiable", () if self.src == BATCH else self.spec.differentiable)

    @property
    def skips(self) -> bool:
        """Whether the edge bypasses at least one stage in topological order (stage order): a
        residual from stage 0 to stage 2, or a batch input read first by stage 1 or later."""
        return self.dst > (0 if self.src == BATCH else self.src + 1)

    @property
    def grad_specs(self) -> list[TensorSpec]:
        return [self.spec.tensors[i] for i in self.differentiable]


@dataclass(frozen=True, slots=True)
class Dataflow:
    num_stages: int
    edges: tuple[Edge, ...]
    """Every tensor edge between stages (and from the batch), in a fixed order."""
    tied: tuple[TiedParameter, ...] = ()
    """Parameters shared by more than one stage (tied embeddings)."""

    def carried_in(self, dtype: str) -> Dataflow:
        """The same dataflow with every floating tensor between two stages travelling as ``dtype``
        (mixed precision: bfloat16 on the wire, each stage computing in its own dtypes); the batch's
        tensors go as the client gives them."""

        def wire(e: Edge) -> Edge:
            if e.src == BATCH:
                return e
            tensors = tuple(TensorSpec(t.shape, dtype) if t.is_floating else t for t in e.spec.tensors)
            return Edge(e.src, e.dst, e.src_indices, e.dst_indices, EdgeSpec(e.spec.name, tensors))

        return Dataflow(self.num_stages, tuple(wire(e) for e in self.edges), self.tied)

    def incoming(self, stage: int) -> list[tuple[int, Edge]]:
        return [(i, e) for i, e in enumerate(self.edges) if e.dst == stage]

    def outgoing(self, stage: int) -> list[tuple[int, Edge]]:
        return [(i, e) for i, e in enumerate(self.edges) if e.src == stage]

    def to_pb(self) -> tuple[list[pb.DataflowEdge], list[pb.TiedParameter]]:
        edges = [
            pb.DataflowEdge(
                src=e.src, dst=e.dst, src_indices=e.src_indices, dst_indices=e.dst_indices, spec=spec_to_pb(e.spec)
            )
            for e in self.edges
        ]
        tied = [pb.TiedParameter(name=t.name, stages=t.stages, spec=tensor_spec_to_pb(t.spec)) for t in self.tied]
        return edges, tied

    @staticmethod
    def from_pb(num_stages: int, edges, tied) -> Dataflow:
        return Dataflow(
            num_stages,
            tuple(Edge(e.src, e.dst, tuple(e.src_indices), tuple(e.dst_indices), spec_from_pb(e.spec)) for e in edges),
            tuple(
                TiedParameter(t.name, tuple(t.stages), tensor_spec_from_pb(t.spec, f"tied parameter {t.name}"))
                for t in tied
            ),
        )


@dataclass(frozen=True, slots=True)
class TiedParameter:
    name: str
    """The parameter's name in every stage that holds it (its first name in the model)."""
    stages: tuple[int, ...]
    """The stages that hold a copy, ascending; their gradients are summed before each update."""
    spec: TensorSpec


class Routes:
    """The dataflow once placed: per stage, its remote and local edges in each direction, and
    what its receives, sends and gradients need (computed once: the executor asks on every
    microbatch)."""

    def __init__(self, flow: Dataflow, stage_ranks: Sequence[int]):
        self.flow = flow
        self.stage_ranks = list(stage_ranks)
        n = flow.num_stages
        inc = [flow.incoming(s) for s in range(n)]
        out = [flow.outgoing(s) for s in range(n)]
        batch = lambda es: [(i, e) for i, e in es if e.src == BATCH]  # noqa: E731
        local = lambda es, yes: [(i, e) for i, e in es if e.src != BATCH and self.is_local(e) == yes]  # noqa: E731
        self._remote_in = [local(es, False) for es in inc]
        self._local_in = [local(es, True) for es in inc]
        self._batch_in = [batch(es) for es in inc]
        self._remote_out = [local(es, False) for es in out]
        self._local_out = [local(es, True) for es in out]
        self._recv_f_specs = [[t for _, e in es for t in e.spec.tensors] for es in self._remote_in]
        self._recv_b_specs = [[t for _, e in es for t in e.grad_specs] for es in self._remote_out]
        self._sends_b = [any(e.differentiable for _, e in es) for es in self._remote_in]
        self._grad_readers = [
            sum(1 for _, e in self._local_in[s] if e.differentiable) + self._sends_b[s] for s in range(n)
        ]

    def is_local(self, edge: Edge) -> bool:
        """Both ends on one rank: a hand-off in memory, no transport."""
        return edge.src != BATCH and self.stage_ranks[edge.src] == self.stage_ranks[edge.dst]

    def remote_in(self, stage: int) -> list[tuple[int, Edge]]:
        """Edges into ``stage`` that arrive over a transport (its RECV_F, the producers' SEND_F)."""
        return self._remote_in[stage]

    def local_in(self, stage: int) -> list[tuple[int, Edge]]:
        return self._local_in[stage]

    def batch_in(self, stage: int) -> list[tuple[int, Edge]]:
        return self._batch_in[stage]

    def remote_out(self, stage: int) -> list[tuple[int, Edge]]:
        return self._remote_out[stage]

    def local_out(self, stage: int) -> list[tuple[int, Edge]]:
        return self._local_out[stage]

    def recv_f_specs(self, stage: int) -> list[TensorSpec]:
        """What one RECV_F of ``stage`` fills: every remote incoming edge's tensors, in edge order."""
        return self._recv_f_specs[stage]

    def recv_b_specs(self, stage: int) -> list[TensorSpec]:
        """What one RECV_B of ``stage`` fills: the gradients of its remote outgoing edges."""
        return self._recv_b_specs[stage]

    def needs_recv_f(self, stage: int) -> bool:
        return bool(self._remote_in[stage])

    def sends_f(self, stage: int) -> bool:
        return bool(self._remote_out[stage])

    def needs_recv_b(self, stage: int) -> bool:
        return bool(self._recv_b_specs[stage])

    def sends_b(self, stage: int) -> bool:
        return self._sends_b[stage]

    def grad_readers(self, stage: int) -> int:
        """How many take the gradients of ``stage``'s inputs: each local producer, and one SEND_B
        for all the remote ones."""
        return self._grad_readers[stage]

    @cached_property
    def tied_ranks(self) -> dict[int, list[int]]:
        """Per tied group (index into flow.tied): the ranks holding it, in rank order."""
        return {g: sorted({self.stage_ranks[s] for s in t.stages}) for g, t in enumerate(self.flow.tied)}

    def reduces_on(self, rank: int) -> bool:
        """Whether ``rank`` must sum tied gradients before its optimizer step (REDUCE_GRAD)."""
        return any(rank in ranks for ranks in self.tied_ranks.values())

    def tied_recv_specs(self, rank: int) -> list[TensorSpec]:
        """The buffers REDUCE_GRAD on ``rank`` receives into: each tied parameter it holds, once
        per other rank holding it."""
        return [
            self.flow.tied[g].spec for g, ranks in self.tied_ranks.items() if rank in ranks for r in ranks if r != rank
        ]

    def tied_peers(self, rank: int) -> set[int]:
        return {r for ranks in self.tied_ranks.values() if rank in ranks for r in ranks} - {rank}
