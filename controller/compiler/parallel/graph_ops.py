"""The ATen ops the tensor- and sequence-parallel passes reason about, and the value an exported
graph's node carries (its fake tensor), shared by controller/compiler/parallel/tensor/ and
controller/compiler/parallel/sequence.py."""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten
LINEAR = aten.linear.default  # (x, weight [out, in], bias)
ADDMM = aten.addmm.default  # (bias, x, weight [in, out]): transformers' Conv1D
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
SAME_SHAPE = {
    aten.dropout.default,
    aten.clone.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.detach.default,
    aten.to.dtype,
    aten.to.dtype_layout,
    aten._to_copy.default,
}
"""Ops whose output is their input's shape, element for element."""


def tensor_value(node) -> torch.Tensor | None:
    """The (fake) tensor a graph node computes, or None for anything else."""
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None
