"""Walks over a backward graph (torch.autograd's nodes), shared by the split backward and the fused
linear weight gradients."""

from __future__ import annotations

import collections

import torch
from torch.autograd.graph import Node


def node_of(t: torch.Tensor) -> Node | None:
    """The autograd node a tensor's gradient flows into (a leaf's accumulator, made on demand)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]


def parents_of(roots: list[Node]) -> dict[Node, list[Node]]:
    """For each node below ``roots``, the nodes whose backward feeds it."""
    parents: dict[Node, list[Node]] = collections.defaultdict(list)
    todo, seen = collections.deque(roots), set(roots)
    while todo:
        node = todo.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return parents


def walk(roots: list[Node]) -> tuple[list[Node], tuple]:
    """The nodes below ``roots`` in breadth-first order, and the graph's shape: each node's type
    and its edges as positions in that order (with the edges' input numbers). Two graphs of the
    same shape are the same graph but for the nodes' identities and saved values, so what is
    found by position in one holds in the other (atoll.core.split_layouts.Layouts)."""
    order = list(dict.fromkeys(roots))
    position = {node: i for i, node in enumerate(order)}
    shape: list = []
    for node in order:  # grows while it is read
        shape.append(type(node))
        for child, input_nr in node.next_functions:
            if child is None:
                shape.append(-1)
                continue
            i = position.get(child)
            if i is None:
                i = position[child] = len(order)
                order.append(child)
            shape += (i, input_nr)
    return order, tuple(shape)


def above(start: list[Node], parents: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes from ``start`` up towards the outputs, not passing ``stop``: (reached, stops met)."""
    reached, met = set(start), set()
    todo = collections.deque(start)
    while todo:
        for parent in parents.get(todo.popleft(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in reached:
                reached.add(parent)
                todo.append(parent)
    return reached, met
