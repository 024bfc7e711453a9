"""A worker's part of a job's state: its weights for ``state_dict``, its tensors for a checkpoint
(keyed as atoll.core.checkpoint says), and loading them back, cut for its island rank."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from atoll.errors import InvalidInput

if TYPE_CHECKING:
    from atoll.worker.executor.interpreter import PipelineExecutor


def _base_names(ex: PipelineExecutor, stage) -> set[str]:
    """The stage's parameters that are a resident base's: neither read nor written through this
    job (its client sees and saves only its own tensors)."""
    return {name for name, p in stage.graph.named_parameters() if id(p) in ex.base}


def state_dict(ex: PipelineExecutor) -> dict[str, torch.Tensor]:
    out = {}
    for stage in ex.stages.values():
        theirs = _base_names(ex, stage)
        out.update({k: v.detach().clone() for k, v in stage.graph.state_dict().items() if k not in theirs})
    return out


def checkpoint_tensors(ex: PipelineExecutor) -> dict[str, torch.Tensor]:
    """Parameters, buffers and optimizer state (a tied parameter held twice here is written once:
    its copies are equal)."""
    if ex.zero is not None:
        raise InvalidInput("checkpoints of ZeRO-1 jobs are not built yet (their optimizer state is a flat shard)")
    out, names = {}, {}
    for stage in ex.stages.values():
        for name, p in stage.graph.named_parameters():
            if id(p) not in ex.base:
                out[f"param/{name}"], names[id(p)] = p, name
        for name, b in stage.graph.named_buffers():
            out[f"buffer/{name}"] = b
    for p, state in ex.optimizer.state.items() if ex.optimizer is not None else ():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optim/{names[id(p)]}/{key}"] = value
            elif value is not None:
                raise InvalidInput(f"optimizer state {key!r} is a {type(value).__name__}, not a tensor")
    return {k: v.detach().clone() for k, v in out.items()}


def restore(ex: PipelineExecutor, reader, cuts: dict) -> None:
    """Load weights and optimizer state from a checkpoint ``reader`` (atoll.core.checkpoint), cut
    for this worker's island rank where ``cuts`` says."""
    rank, ranks = ex.island_rank, ex.island_size

    def local(key: str, name: str, like: torch.Tensor) -> torch.Tensor:
        """``key`` cut as ``like`` (a parameter or buffer) is held here; a 0-d state (a step
        count) as it is."""
        full = reader.full(key, name)
        if full.dim() == 0:
            return full.clone()
        value = cuts[name].local(full, rank, ranks) if name in cuts else full
        if value.shape != like.shape:
            raise InvalidInput(f"checkpoint {key} has shape {list(full.shape)}, this job holds {list(like.shape)}")
        return value.to(like.dtype).clone()

    if ex.zero is not None:
        raise InvalidInput("restoring a ZeRO-1 job is not built yet")
    with torch.no_grad():
        for stage in ex.stages.values():
            for name, p in stage.graph.named_parameters():
                if id(p) in ex.base:
                    continue
                p.copy_(local(f"param/{name}", name, p))
                if ex.optimizer is None:
                    continue
                prefix = f"optim/{name}/"
                state = {k.removeprefix(prefix): k for k in reader.where if k.startswith(prefix)}
                if state:
                    ex.optimizer.state[p] = {key: local(k, name, p) for key, k in state.items()}
            for name, b in stage.graph.named_buffers():
                b.copy_(local(f"buffer/{name}", name, b))
