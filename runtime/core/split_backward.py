"""A stage's backward in two halves, as zero-bubble schedules run it (Qi et al. 2024): first the
gradients of the stage's inputs (what the previous stage waits for), later those of its weights.

The input half runs autograd from the stage's outputs to its inputs only. On the way it passes
the nodes where a path to a weight leaves the path to the inputs (the *frontier*); a pre-hook on
each keeps the gradient flowing into it. The weight half then runs autograd from those kept
gradients to the weights, one group of weights (those meeting the same frontier nodes) at a
time, so it never walks back down the inputs' path. A frontier node runs in both halves, for its
input-side and then its weight-side gradients; every other node once. On 4 blocks of
Linear(1024, 1024) + GELU at 32 rows, one thread: I + W 0.99x B (B with its linear layers'
weight gradients added in place too).
torch.distributed.pipelining splits its backward the same way (its ``stage_backward_input``).

A group that is one linear layer's weight and bias takes no second autograd pass: its weight
half is one GEMM from the kept gradient added into ``.grad`` (atoll.core.linear_grads). Nor does
a group whose weights hang straight off one normalization or elementwise node (a layer norm's
weight and bias): the weight half calls that node on its kept gradient. A pass through autograd's
engine from a node first walks the whole graph below it: on the GPT example's 2-block stage
(microbatches of 4 x 64 tokens, one thread) I + W cost 1.43x the whole backward B with its four
layer norms' passes, 1.22x with the direct calls, 1.16x with the input half's analysis of the
graph kept across microbatches (atoll.core.split_layouts; ``backward_input``'s ``layouts``).

The weight half runs without grad mode, as autograd's own accumulation does: a training step runs
its actions in grad mode, where a product with a saved activation (a linear layer's in-place
GEMM) recorded a graph onto ``.grad`` that kept every microbatch's forward graph alive until the
gradients were zeroed (on that stage I + W cost 1.7x B with the gradients zeroed after each
microbatch, 2.0x kept over microbatches as a step keeps them, each forward after 1.6x slower;
on the 1024-wide blocks 1.08-1.18x).

Where the frontier does not reach every weight that gets a gradient (a first stage, whose
inputs need none; a weight whose path never meets an input's), the input half computes the input
gradients keeping the whole graph, and the weight half runs the whole backward to the weights.
Gradients are the same either way; only the work differs.

The same code runs on fake tensors at compile time, so the bytes kept between the halves are
predicted as the worker counts them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.autograd.graph import GradientEdge, Node

from atoll.core import linear_grads
from atoll.core.autograd_graph import above, node_of, parents_of
from atoll.core.memory import storage_bytes, storage_key

if TYPE_CHECKING:
    from atoll.core.split_layouts import Layouts


@dataclass(eq=False)
class Group:
    """Weights whose paths meet the inputs' at the same frontier nodes, and those nodes' kept
    gradients: the weight half runs autograd once per group, to its weights alone, so it never
    walks back down the inputs' path to reach another group's weights."""

    weights: dict[Node, torch.Tensor]
    """Each weight's gradient accumulator, and the weight."""
    frontier: list[Node]
    kept: dict[Node, list] = field(default_factory=dict)
    linear: linear_grads.Linear | None = None
    """Set where the group is one linear layer's weight and bias: its gradients are added in place."""
    direct: list[int] | None = None
    """Set where the group's one frontier node takes every weight straight from its accumulator
    (a layer norm's weight and bias): each weight's position among the node's outputs, so the
    weight half calls the node itself (``_direct``)."""


@dataclass(eq=False)
class WeightHalf:
    """What the weight half of one microbatch's backward needs: the groups' kept gradients, or
    (the fallback) the outputs and their gradients with the whole graph kept."""

    groups: list[Group] | None
    roots: list[torch.Tensor]
    root_grads: list[torch.Tensor] | None

    def kept(self) -> list[torch.Tensor]:
        """The gradients held for the weight half (counted as a stage's held bytes)."""
        return [g for group in self.groups or () for grads in group.kept.values() for g in grads if g is not None]


def _groups(
    weights: dict[Node, torch.Tensor], parents, towards_inputs: set[Node], tops: set[Node]
) -> list[Group] | None:
    """The weights grouped by the frontier nodes they meet; None where some weight's path reaches
    an output without meeting the inputs' paths (gradient the frontier would not see)."""
    groups: list[Group] = []
    owner: dict[Node, Group] = {}
    for node, weight in weights.items():
        reached, met = above([node], parents, towards_inputs)
        if reached & tops or not met:
            return None
        joined = {id(owner[n]): owner[n] for n in met if n in owner}
        group = Group({node: weight}, list(met))
        for other in joined.values():  # shared frontier nodes: one group
            groups.remove(other)
            group.weights |= other.weights
            group.frontier += [n for n in other.frontier if n not in group.frontier]
        groups.append(group)
        for n in group.frontier:
            owner[n] = group
    return groups


def backward_input(
    roots: list[torch.Tensor],
    root_grads: list[torch.Tensor] | None,
    inputs: list[torch.Tensor],
    weights: list[torch.Tensor],
    layouts: Layouts | None = None,
) -> WeightHalf:
    """Compute the gradients of ``inputs`` (into their ``.grad``) from ``roots`` (the stage's
    outputs with ``root_grads``, or its loss with None), keeping what ``backward_weight`` needs.
    ``layouts``: the stage's analysis kept from its earlier microbatches (a worker's, see
    ``Layouts``); without it the graph is analysed afresh."""
    wanted = [t for t in inputs if t.requires_grad]
    if not roots:  # no output carries a gradient (an integer-only edge): nothing to do in either half
        return WeightHalf(None, [], None)
    groups = None
    if wanted:
        root_nodes = [n for n in map(node_of, roots) if n is not None]
        groups = (layouts.groups if layouts is not None else analyse)(root_nodes, wanted, weights)
    if groups is None:  # the fallback: the weight half runs the whole backward
        if wanted:
            grads = torch.autograd.grad(roots, wanted, root_grads, retain_graph=True, allow_unused=True)
            _accumulate(wanted, grads, root_grads or [])
        return WeightHalf(None, roots, root_grads)
    hooks = [node.register_prehook(_keeper(group.kept, node)) for group in groups for node in group.frontier]
    try:
        grads = torch.autograd.grad(roots, wanted, root_grads, retain_graph=True, allow_unused=True)
    finally:
        for hook in hooks:
            hook.remove()
    _accumulate(wanted, grads, root_grads or [])
    # The outputs keep the graph above the frontier alive until W (torch detaches them in place
    # here, which breaks a weight half that reads an output saved by its own op, as tanh saves its
    # result); the plan counts a microbatch's whole stash as held until W.
    return WeightHalf(groups, [], None)


def analyse(root_nodes: list[Node], wanted: list[torch.Tensor], weights: list[torch.Tensor]) -> list[Group] | None:
    """The weight groups of the graph under ``root_nodes``, each with how its weight half runs
    (``_weight_gradients``); None where the frontier does not reach every weight (the fallback)."""
    parents = parents_of(root_nodes)
    by_node = {n: w for w in weights if (n := node_of(w)) is not None and n in parents}
    input_nodes = [n for n in map(node_of, wanted) if n is not None]
    towards_inputs, _ = above(input_nodes, parents, set())
    groups = _groups(by_node, parents, towards_inputs, set(root_nodes) - towards_inputs)
    for group in groups or ():
        if len(group.frontier) == 1:
            linear = linear_grads.find(group.frontier[0], group.weights, parents)
            if linear is not None and len(group.weights) == 1 + (linear.bias is not None):
                group.linear = linear
            else:
                group.direct = _direct_positions(group.frontier[0], group.weights)
    return groups


def held_bytes(half: WeightHalf, root_grads: list[torch.Tensor] | None, exclude: set[int]) -> int:
    """Bytes of the gradients ``half`` keeps, leaving out the output gradients themselves (a
    receive buffer is counted as a buffer) and the storages in ``exclude`` (counted elsewhere)."""
    exclude = exclude | {storage_key(g) for g in root_grads or ()}
    return storage_bytes(g for g in half.kept() if storage_key(g) not in exclude)


DIRECT_NODES = frozenset(
    {
        "NativeLayerNormBackward0",
        "NativeGroupNormBackward0",
        "NativeBatchNormBackward0",
        "MulBackward0",  # a scale, as RMSNorm's weight
        "AddBackward0",
    }
)
"""Nodes whose weight gradients the weight half takes by calling the node itself. Called outside
autograd's engine a node computes every gradient it has, its input's too: for these that is one
elementwise or normalization pass, cheaper than the engine's walk; a convolution's or a matrix
product's input gradient would cost as much as its weight's."""


def _direct_positions(node: Node, weights: dict[Node, torch.Tensor]) -> list[int] | None:
    """Where each of ``weights`` (accumulator -> weight, in order) enters ``node``, one of
    ``DIRECT_NODES``, directly as one of its next functions; None where one does not, or enters
    more than once."""
    if node.name() not in DIRECT_NODES:
        return None
    positions = {}
    for i, (child, _) in enumerate(node.next_functions):
        if child in weights:
            if child in positions:
                return None
            positions[child] = i
    return [positions[a] for a in weights] if len(positions) == len(weights) else None


def _keeper(kept: dict, node: Node):
    def hook(grad_outputs):
        kept[node] = list(grad_outputs)

    return hook


def _accumulate(
    tensors: list[torch.Tensor],
    grads,
    given: list[torch.Tensor | None],
    ready: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """Into ``.grad``, as autograd accumulates: the first taken in the tensor's own layout (a
    weight's gradient comes out of its transpose's backward transposed), later ones added in
    place; each tensor added to handed to ``ready``, as autograd calls a post-accumulate hook.
    A gradient on the storage of one of the ``given`` ones (the gradients the pass started
    from, which an add's backward passes on as they are: a receive buffer the next microbatch
    overwrites) is copied, as autograd copies a gradient something else still holds."""
    borrowed = {storage_key(g) for g in given if g is not None}
    for t, g in zip(tensors, grads):
        if g is None:
            continue
        if t.grad is None:
            own = g.stride() == t.stride() and storage_key(g) not in borrowed
            t.grad = g if own else g.clone(memory_format=torch.contiguous_format)
        else:
            t.grad.add_(g)
        if ready is not None:
            ready(t)


def backward_weight(
    half: WeightHalf,
    weights: list[torch.Tensor],
    fuse: bool = True,
    ready: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """Accumulate the weights' gradients (into ``.grad``) from what ``backward_input`` kept.
    ``fuse=False`` leaves the fallback's whole backward to autograd. ``ready`` is called with
    each weight as its gradient is added here (autograd's post-accumulate hooks fire for what
    autograd accumulates itself), so that the data-parallel buckets take each final gradient as
    it comes."""
    if half.groups is None:
        if half.roots:
            wanted = [w for w in weights if w.requires_grad]
            if fuse:
                linear_grads.backward(half.roots, half.root_grads, wanted, ready)
            else:
                torch.autograd.backward(half.roots, half.root_grads, inputs=wanted)
        return
    with torch.no_grad():  # as autograd accumulates (see the module's docstring)
        for group in half.groups:
            _weight_gradients(group, ready)
    half.groups = None


def _weight_gradients(group: Group, ready: Callable[[torch.Tensor], None] | None) -> None:
    """One group's weight gradients from its kept gradients: one GEMM for a linear layer, the
    frontier node itself where the weights hang straight off it, else autograd from the kept
    gradients to the weights."""
    if group.linear is not None:
        kept = group.kept.get(group.linear.node) or [None]
        if kept[0] is not None:
            group.linear.accumulate(kept[0], ready)
        return
    if group.direct is not None:
        _direct(group, ready)
        return
    edges, grads = [], []
    for node in group.frontier:
        for i, g in enumerate(group.kept.get(node, ())):
            if g is not None:
                edges.append(GradientEdge(node, i))
                grads.append(g)
    if not edges:
        return
    # A frontier node below another of the group would get the upper one's gradient on top of
    # its own kept total: a pre-hook puts back exactly what it received in the input half.
    hooks = []
    if len(group.frontier) > 1:
        hooks = [n.register_prehook(lambda _, kept=tuple(group.kept.get(n, ())): kept) for n in group.frontier]
    try:
        found = torch.autograd.grad(edges, [GradientEdge(n, 0) for n in group.weights], grads, allow_unused=True)
    finally:
        for hook in hooks:
            hook.remove()
    _accumulate(list(group.weights.values()), found, grads, ready)


def _direct(group: Group, ready: Callable[[torch.Tensor], None] | None) -> None:
    """The weight half of a group whose one frontier node takes its weights straight from their
    accumulators: that node called on its kept gradients, outside autograd's engine, each weight's
    gradient then summed to its shape and cast to its dtype as the engine does with a node's
    outputs (a broadcast scale's). The node also computes its input gradient, discarded."""
    (node,) = group.frontier
    kept = group.kept.get(node)
    if not kept or all(g is None for g in kept):
        return
    found = node(*kept)
    grads = []
    for weight, i in zip(group.weights.values(), group.direct):
        g = found[i]
        if g is not None and g.shape != weight.shape:
            g = g.sum_to_size(weight.shape)
        grads.append(g if g is None or g.dtype == weight.dtype else g.to(weight.dtype))
    _accumulate(list(group.weights.values()), grads, kept, ready)
