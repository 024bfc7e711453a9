"""Client-side export: the whole model and the loss, each exported once with torch.export.

The client only exports; every decision (where to cut stages, schedule, buffers) is the
controller's. What leaves the client is serialized exported graphs and specs, never pickled user
code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from atoll.core.graphs import export
from atoll.core.wire import EdgeSpec, TensorSpec
from atoll.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class ExportedPipeline:
    model: bytes
    loss: bytes
    input: EdgeSpec
    target: EdgeSpec
    aliases: dict[str, str]


class _Loss(nn.Module):
    """Gives a plain loss function a module to export."""

    def __init__(self, loss_fn):
        super().__init__()
        self.loss_fn = loss_fn

    def forward(self, output, target):
        return self.loss_fn(output, target)


def as_leaves(value, what: str) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return list(value)
    raise InvalidInput(f"{what} must be a tensor or a tuple of tensors, got {type(value).__name__}")


def _microbatch(value, microbatches: int, what: str):
    leaves = as_leaves(value, what)
    for t in leaves:
        if t.dim() == 0 or t.shape[0] % microbatches:
            raise InvalidInput(
                f"{what}: batch dimension of shape {list(t.shape)} is not divisible into {microbatches} microbatches"
            )
    chunks = [t[: t.shape[0] // microbatches] for t in leaves]
    return chunks[0] if isinstance(value, torch.Tensor) else type(value)(chunks)


def shared_names(model: nn.Module) -> dict[str, str]:
    """Other names of tensors the model holds under several names (tied weights) -> first name.
    An exported archive stores each name separately, so the sharing travels beside it."""
    first: dict[int, str] = {}
    aliases = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, t in named:
        owner = first.setdefault(id(t), name)
        if owner != name:
            aliases[name] = owner
    return aliases


def split_names(model: nn.Module, split_points) -> list[str]:
    """Split points as module names; an integer ``i`` names the model's ``i``-th top-level child
    (so block indices keep working for an ``nn.Sequential``)."""
    children = [name for name, _ in model.named_children()]
    names = []
    for point in split_points or []:
        if isinstance(point, bool) or not isinstance(point, (int, str)):
            raise InvalidInput(f"a split point is a module name or a child index, got {point!r}")
        if isinstance(point, int):
            if not 0 < point < len(children):
                raise InvalidInput(
                    f"split point {point} is not a child index in 1..{len(children) - 1} of {type(model).__name__}"
                )
            point = children[point]
        names.append(point)
    return names


def export_pipeline(
    model: nn.Module, example_input, example_target, loss_fn, microbatches: int, frozen_values: bool = True
) -> ExportedPipeline:
    """``frozen_values=False`` for a job attached to a resident base: its frozen parameters are the
    base's tensors on the workers, so only their shapes travel (not a copy of the base per job)."""
    if not isinstance(microbatches, int) or microbatches < 1:
        raise InvalidInput(f"microbatches must be a positive integer, got {microbatches!r}")
    if not isinstance(model, nn.Module):
        raise InvalidInput(f"model must be an nn.Module, got {type(model).__name__}")
    x = _microbatch(example_input, microbatches, "example_input")
    target = _microbatch(example_target, microbatches, "example_target")
    program = export(model, (x,), f"torch.export failed for the model ({type(model).__name__})", frozen_values)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):  # the model's state and RNG stay as they were
        state = {k: v.clone() for k, v in model.state_dict().items()}
        output = model(x)
        model.load_state_dict(state)
    loss = export(_Loss(loss_fn), (output, target), "torch.export failed for loss_fn")
    spec = lambda value, what: EdgeSpec(what, tuple(TensorSpec.of(t) for t in as_leaves(value, what)))  # noqa: E731
    return ExportedPipeline(
        program, loss, spec(example_input, "input"), spec(example_target, "target"), shared_names(model)
    )
