"""Exported stage graphs: safe loading, and running a chain of blocks on flat tensor lists.

Edges between stages are flat lists of tensors; each block's exported call spec restores the
structure (tensor, tuple, dict) its forward expects, exactly as ``nn.Sequential`` would pass it.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence

import torch
import torch.utils._pytree as pytree

from runtime.errors import InvalidInput

# torch.export.load falls back to full unpickling when a weights-only load fails; this makes
# torch.load refuse instead. Daemons set it at start unless the operator opts in to pickle.
FORCE_WEIGHTS_ONLY_ENV = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


def forbid_pickle(allow_pickle: bool = False) -> None:
    if not allow_pickle:
        os.environ[FORCE_WEIGHTS_ONLY_ENV] = "1"


def serialize(ep: torch.export.ExportedProgram) -> bytes:
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    return buf.getvalue()


def deserialize(data: bytes, what: str) -> torch.export.ExportedProgram:
    try:
        return torch.export.load(io.BytesIO(data))
    except Exception as e:
        raise InvalidInput(
            f"{what}: not a loadable torch.export archive "
            f"(arbitrary pickled objects are refused): {type(e).__name__}: {e}"
        ) from None


def flatten(value) -> list[torch.Tensor]:
    leaves, _ = pytree.tree_flatten(value)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise InvalidInput(f"edges carry tensors only, found {type(leaf).__name__}")
    return leaves


class BlockGraph:
    """One exported top-level block, ready to call."""

    def __init__(self, name: str, ep: torch.export.ExportedProgram):
        self.name = name
        # Inputs are checked once, against the compiled specs (the controller checks batches,
        # receive buffers are allocated from the specs); torch's per-call guards and structure
        # checks would repeat that on every microbatch, at about a tenth of a small stage's time.
        self.module = ep.module(check_guards=False)
        self.module.validate_inputs = False
        self.in_spec = ep.call_spec.in_spec

    def call_flat(self, leaves: Sequence[torch.Tensor]):
        args, kwargs = pytree.tree_unflatten(list(leaves), self.in_spec)
        return self.module(*args, **kwargs)


class StageGraph:
    """Contiguous blocks run in order: flat input tensors -> structured output."""

    def __init__(self, blocks: list[BlockGraph]):
        if not blocks:
            raise InvalidInput("a stage needs at least one block")
        self.blocks = blocks

    def forward(self, leaves: Sequence[torch.Tensor]):
        out = self.blocks[0].call_flat(leaves)
        for block in self.blocks[1:]:
            out = block.module(out)
        return out

    def named_parameters(self):
        for block in self.blocks:
            for name, p in block.module.named_parameters():
                yield f"{block.name}.{name}", p

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{block.name}.{k}": v for block in self.blocks for k, v in block.module.state_dict().items()}

    def to(self, device) -> StageGraph:
        for block in self.blocks:
            block.module.to(device)
        return self
