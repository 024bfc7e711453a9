"""A split backward's analysis of a stage's graph kept across microbatches, by position.

The input half (atoll.core.split_backward) analyses the autograd graph under a stage's outputs:
its parents, the nodes towards the inputs, each weight's way up to the frontier, the linear
layers and the nodes the weight half calls directly. A stage's graph has the same shape every
microbatch (the same exported program on tensors of the same shapes); only its nodes are new.
On the GPT example's 2-block stage (85 nodes; microbatches of 4 x 64 tokens, one thread) the
analysis cost about 0.2 ms a microbatch (I + W 1.24x the whole backward, median of 1,500; 1.16x
with it kept); walking the graph once to compare its shape costs about 0.02 ms. So it is kept
as positions in that walk (``atoll.core.autograd_graph.walk``) and bound to the new nodes while
the shape stays the same; any other shape, or an input or weight not where it was, is analysed
afresh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.graph import Node

from atoll.core import linear_grads
from atoll.core.autograd_graph import node_of, walk
from atoll.core.split_backward import Group, analyse

_STALE = object()
"""``_Layout.bind``'s answer where a tensor is not where the kept analysis found it."""


@dataclass(frozen=True, slots=True)
class _GroupLayout:
    weights: tuple[tuple[int, int], ...]
    """Each weight's accumulator as (its position in the walk, the weight's index in the stage's weights)."""
    frontier: tuple[int, ...]
    linear: tuple[int, int, int] | None
    """A linear layer's (input node position, weight index, bias index), -1 for none."""
    direct: list[int] | None


@dataclass(frozen=True, slots=True)
class _Layout:
    shape: tuple
    """The shape of the graph it was found on (``walk``'s)."""
    inputs: tuple[int, ...]
    """The positions of the wanted inputs' nodes."""
    groups: tuple[_GroupLayout, ...] | None

    @classmethod
    def of(cls, groups: list[Group] | None, order: list[Node], shape: tuple, wanted, weights) -> _Layout | None:
        """``groups`` (``analyse``'s answer on the graph of ``shape`` walked as ``order``) by
        position; None where a node they name lies outside the walk (an input the graph does not
        use)."""
        position = {node: i for i, node in enumerate(order)}
        index = {id(w): i for i, w in enumerate(weights)}
        try:
            inputs = tuple(position[node_of(t)] for t in wanted)
            kept = None
            if groups is not None:
                kept = tuple(
                    _GroupLayout(
                        tuple((position[n], index[id(w)]) for n, w in g.weights.items()),
                        tuple(position[n] for n in g.frontier),
                        None if g.linear is None else _linear_layout(g.linear, position, index),
                        g.direct,
                    )
                    for g in groups
                )
        except KeyError:
            return None
        return cls(shape, inputs, kept)

    def bind(self, order: list[Node], wanted, weights):
        """The groups on the nodes of a graph of the same shape walked as ``order``: fresh
        ``Group``s (each microbatch keeps its own gradients), the linear layers' saved inputs
        read from the new nodes; ``_STALE`` where a wanted input or a weight is not the tensor
        at its position."""
        if len(wanted) != len(self.inputs) or any(not _is_node_of(t, order[p]) for t, p in zip(wanted, self.inputs)):
            return _STALE
        if self.groups is None:
            return None
        groups = []
        for kept in self.groups:
            by_node = {}
            for p, i in kept.weights:
                node = order[p]
                if i >= len(weights) or getattr(node, "variable", None) is not weights[i]:
                    return _STALE
                by_node[node] = weights[i]
            group = Group(by_node, [order[p] for p in kept.frontier], direct=kept.direct)
            if kept.linear is not None:
                source, w, b = kept.linear
                node = group.frontier[0]
                group.linear = linear_grads.Linear(
                    node,
                    linear_grads.saved_input(node),
                    order[source] if source >= 0 else None,
                    weights[w],
                    weights[b] if b >= 0 else None,
                )
            groups.append(group)
        return groups


def _linear_layout(linear: linear_grads.Linear, position: dict, index: dict) -> tuple[int, int, int]:
    source = -1 if linear.input_node is None else position[linear.input_node]
    return source, index[id(linear.weight)], -1 if linear.bias is None else index[id(linear.bias)]


def _is_node_of(t: torch.Tensor, node: Node) -> bool:
    return t.grad_fn is node if t.grad_fn is not None else getattr(node, "variable", None) is t


class Layouts:
    """One stage's split-backward analysis, kept from microbatch to microbatch while its graph
    keeps its shape (see the module's docstring). A worker holds one per stage."""

    def __init__(self):
        self._layout: _Layout | None = None
        self.analysed = 0
        """How many times the graph was analysed afresh (the first microbatch, or a new shape)."""

    def groups(self, root_nodes: list[Node], wanted: list[torch.Tensor], weights: list[torch.Tensor]):
        """``split_backward.analyse``'s answer for this microbatch's graph."""
        order, shape = walk(root_nodes)
        if self._layout is not None and shape == self._layout.shape:
            found = self._layout.bind(order, wanted, weights)
            if found is not _STALE:
                return found
        groups = analyse(root_nodes, wanted, weights)
        self.analysed += 1
        self._layout = _Layout.of(groups, order, shape, wanted, weights)
        return groups
