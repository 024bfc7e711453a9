"""Client-side export: split a model into its top-level blocks and export each with torch.export.

The client only exports; every decision (stages, schedule, buffers) is the controller's. What
leaves the client is serialized exported graphs and specs, never pickled user code.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from atoll._graphs import flatten, serialize
from atoll._wire import EdgeSpec, TensorSpec
from atoll.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class ExportedPipeline:
    blocks: list[tuple[str, bytes]]
    loss: bytes
    input: EdgeSpec
    target: EdgeSpec


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


def top_level_blocks(model: nn.Module, example_input) -> list[tuple[str, nn.Module]]:
    """The model's children, checked to compute the model when run one after another."""
    blocks = list(model.named_children())
    if not blocks:
        raise InvalidInput(f"cannot split {type(model).__name__}: it has no top-level children")
    seen: dict[int, str] = {}
    for name, block in blocks:
        for pname, p in block.named_parameters():
            owner = seen.setdefault(id(p), f"{name}.{pname}")
            if not owner.startswith(f"{name}."):
                raise InvalidInput(
                    f"parameter {name}.{pname} is shared with {owner}; "
                    f"blocks that share weights cannot be split into stages"
                )
    if isinstance(model, nn.Sequential):
        return blocks
    try:
        # the same random stream for both runs, so dropout in training mode compares equal
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            state = torch.get_rng_state()
            expected = model(example_input)
            torch.set_rng_state(state)
            x = example_input
            for _, block in blocks:
                x = block(x)
        same = all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(flatten(expected), flatten(x)))
        same = same and len(flatten(expected)) == len(flatten(x))
    except Exception as e:
        raise InvalidInput(
            f"cannot split {type(model).__name__}: running its top-level children "
            f"in order fails ({type(e).__name__}: {e}); give an nn.Sequential or a "
            f"module whose children run one after another"
        ) from None
    if not same:
        raise InvalidInput(
            f"cannot split {type(model).__name__}: running its top-level children "
            f"in order does not reproduce its forward; give an nn.Sequential or a "
            f"module whose children run one after another"
        )
    return blocks


def _export(module: nn.Module, args: tuple, what: str) -> bytes:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return serialize(torch.export.export(module, args))
    except Exception as e:
        raise InvalidInput(f"torch.export failed for {what}: {type(e).__name__}: {e}") from None


def export_pipeline(model: nn.Module, example_input, example_target, loss_fn, microbatches: int) -> ExportedPipeline:
    if not isinstance(microbatches, int) or microbatches < 1:
        raise InvalidInput(f"microbatches must be a positive integer, got {microbatches!r}")
    blocks = top_level_blocks(model, example_input)
    x = _microbatch(example_input, microbatches, "example_input")
    target = _microbatch(example_target, microbatches, "example_target")
    exported = []
    for name, block in blocks:
        exported.append((name, _export(block, (x,), f"block '{name}'")))
        with torch.no_grad():
            x = block(x)
    loss = _export(_Loss(loss_fn), (x, target), "loss_fn")
    spec = lambda value, what: EdgeSpec(what, tuple(TensorSpec.of(t) for t in as_leaves(value, what)))  # noqa: E731
    return ExportedPipeline(exported, loss, spec(example_input, "input"), spec(example_target, "target"))
