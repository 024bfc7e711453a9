"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models") on top of the tensor-parallel cuts of a stage (controller/compiler/parallel/tensor/).

Between a row-parallel layer and the next column-parallel one, a transformer runs code that works
token by token (residual adds, LayerNorm, dropout, biases): there each island rank keeps only its
slice of the sequence (dimension 1 of a [batch, sequence, hidden] activation), so those
activations take 1/T of the memory. The row-parallel layer's partial sums are reduce-scattered
into slices instead of all-reduced; the column-parallel layer's input is all-gathered from the
slices instead of passed through f. Activations entering the stage are sliced as they arrive and
those leaving it gathered, so edges between stages carry whole tensors, as without it. A whole
parameter read by sliced code gets only its slice's share of the gradient on each rank: it is read
through f (island_copy), whose backward sums the shares over the island.

This module decides, node by node, what each value is (whole, sliced along the sequence, or a
partial sum still to reduce) and which collective each use needs; the tensor-parallel rewrite
applies it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import fx

from atoll.controller.compiler.parallel.graph_ops import ADDMM, LINEAR, SAME_SHAPE, VIEWS, aten
from atoll.controller.compiler.parallel.graph_ops import tensor_value as _val
from atoll.errors import InvalidInput

TOKENWISE = {aten.layer_norm.default, *SAME_SHAPE}


@dataclass(slots=True)
class SequencePlan:
    tokens: dict = field(default_factory=dict)
    """Sliced node -> (batch, sequence) of its whole value."""
    partial: set = field(default_factory=set)
    """Nodes holding a partial sum over the island (a row-parallel output not yet reduced)."""
    uses: dict = field(default_factory=dict)
    """Consumer node -> {input node: (collective, dim)}: "scatter", "gather", "gather_whole",
    "reduce_scatter", "all_reduce" or "grad_sum" (a whole parameter read by sliced code)."""
    local_args: dict = field(default_factory=dict)
    """Reshapes of sliced values -> their arguments at the slice's size."""
    entry: set = field(default_factory=set)
    """Stage inputs sliced as they arrive."""


def _tokenwise(n: fx.Node, column: set) -> bool:
    """Code that treats every token alike: whole-row ops over the hidden dimension, or element-wise."""
    if n.target in TOKENWISE or torch.Tag.pointwise in getattr(n.target, "tags", ()):
        return True
    return n.target in (LINEAR, ADDMM) and n not in column  # a linear layer left whole


def plan_sequence(gm: fx.GraphModule, ranks: int, column: set, row: set, embedding: set, sharded: dict) -> SequencePlan:
    """``column``/``row``/``embedding``: the tensor-parallel layers; ``sharded``: node -> its
    tensor-parallel placement (values inside a column/row pair)."""
    p = SequencePlan()
    params = dict(gm.named_parameters())

    def use(n, x, how, dim=1):
        p.uses.setdefault(n, {})[x] = (how, dim)

    def slices(x) -> bool:
        v = _val(x)
        return v is not None and v.dim() == 3 and v.shape[1] % ranks == 0

    for n in gm.graph.nodes:
        ins = list(n.all_input_nodes)
        if n.op == "placeholder":
            v = _val(n)
            if v is not None and v.is_floating_point() and slices(n):
                p.entry.add(n)
                p.tokens[n] = tuple(v.shape[:2])
            continue
        if n.op == "get_attr":
            continue
        if n.op == "output":
            for x in ins:
                if x in p.tokens:
                    use(n, x, "gather_whole")
                elif x in p.partial:
                    use(n, x, "all_reduce")
            continue
        if n in row or n in embedding:
            p.partial.add(n)
            continue
        if n in column or n in sharded:  # inside a tensor-parallel pair: whole inputs
            for x in ins:
                if x in p.tokens:
                    use(n, x, "gather" if n in column else "gather_whole")
                elif x in p.partial:
                    use(n, x, "all_reduce")
            continue
        if n.target in VIEWS and ins[0] in p.partial:
            p.partial.add(n)  # a reshape of a sum is the sum of the reshapes
            continue
        if n.target in VIEWS and ins[0] in p.tokens:
            _view(n, ins[0], p, ranks)
            continue
        if _val(n) is None:  # e.g. an assertion on a tensor's metadata
            continue
        if _tokenwise(n, column) and any(x in p.tokens or x in p.partial for x in ins):
            for x in ins:
                if x in p.partial:
                    if not slices(x):
                        raise InvalidInput(
                            f"sequence parallelism: '{x.name}' is a row-parallel sum of shape {list(_val(x).shape)}, "
                            "not [batch, sequence, hidden] with a sequence the island divides"
                        )
                    use(n, x, "reduce_scatter")  # and later uses read the slice
                    p.tokens[x] = tuple(_val(x).shape[:2])
                    p.partial.discard(x)
            out = _val(n)
            (batch_seq,) = {p.tokens[x] for x in ins if x in p.tokens}
            for x in ins:
                if x in p.tokens or x in p.partial:
                    continue
                if x.op == "get_attr" and x.target in params and params[x.target].requires_grad:
                    use(n, x, "grad_sum")
                v = _val(x)
                if v is not None and out.dim() == 3 and v.dim() >= 2 and v.shape[v.dim() - 2] == batch_seq[1]:
                    use(n, x, "scatter", v.dim() - 2)  # a whole operand with a sequence dimension
                elif v is not None and out.dim() == 2 and v.dim() == 2 and v.shape[0] > 1:
                    raise InvalidInput(f"sequence parallelism: '{n.name}' mixes sliced tokens with whole ones")
            p.tokens[n] = batch_seq
            continue
        for x in ins:  # anything else runs on whole values
            if x in p.tokens:
                use(n, x, "gather_whole")
            elif x in p.partial:
                use(n, x, "all_reduce")
    return p


def _view(n: fx.Node, x: fx.Node, p: SequencePlan, ranks: int) -> None:
    """A reshape of sliced tokens that keeps the hidden size: [B, S, H] <-> [B * S, H]."""
    batch, seq = p.tokens[x]
    shape = list(_val(n).shape)
    if len(shape) == 3 and shape[:2] == [batch, seq]:
        local = [batch, seq // ranks, shape[2]]
    elif len(shape) == 2 and shape[0] == batch * seq:
        local = [batch * seq // ranks, shape[1]]
    else:
        raise InvalidInput(
            f"sequence parallelism: '{n.name}' reshapes a [{batch}, {seq}, ...] activation to {shape}, "
            "which mixes the sequence with other dimensions"
        )
    assert math.prod(local) * ranks == math.prod(shape)
    p.local_args[n] = (n.args[0], local, *n.args[2:])
    p.tokens[n] = (batch, seq)
