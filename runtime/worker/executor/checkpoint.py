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
    """Every replica of a ZeRO-3 job is asked (controller/state.py): they gather the parameters
    from each other's shards for the read, and drop them after."""
    zero3 = ex.zero is not None and ex.zero.stage == 3
    if zero3:
        ex.zero.gather(ex.replicas, ex.timeout_s)
    try:
        out = {}
        for stage in ex.stages.values():
            theirs = _base_names(ex, stage)
            out.update({k: v.detach().clone() for k, v in stage.graph.state_dict().items() if k not in theirs})
        return out
    finally:
        if zero3:
            ex.zero.release()


def checkpoint_tensors(ex: PipelineExecutor) -> dict[str, torch.Tensor]:
    """Parameters, buffers and optimizer state, per parameter (a tied parameter held twice here is
    written once: its copies are equal). A ZeRO job's come whole from the replicas' shards
    (atoll.worker.executor.zero, ``export``): every replica takes part, replica 0's are written."""
    out, names = {}, {}
    sharded = {id(p) for p in ex.zero.params} if ex.zero is not None else set()
    for stage in ex.stages.values():
        for name, p in stage.graph.named_parameters():
            if id(p) not in ex.base:
                names[id(p)] = name
                if id(p) not in sharded:
                    out[f"param/{name}"] = p
        for name, b in stage.graph.named_buffers():
            out[f"buffer/{name}"] = b
    if ex.zero is not None:
        try:
            params, state = ex.zero.export(ex.replicas, ex.timeout_s)
        except ValueError as e:
            raise InvalidInput(str(e)) from None
        for i, p in enumerate(ex.zero.params):
            out[f"param/{names[id(p)]}"] = params[i]
            out.update({f"optim/{names[id(p)]}/{key}": values[i] for key, values in state.items()})
        return {k: v.detach().clone() for k, v in out.items()}
    for p, state in ex.optimizer.state.items() if ex.optimizer is not None else ():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optim/{names[id(p)]}/{key}"] = value
            elif value is not None:
                raise InvalidInput(f"optimizer state {key!r} is a {type(value).__name__}, not a tensor")
    return {k: v.detach().clone() for k, v in out.items()}


def restore(ex: PipelineExecutor, reader, cuts: dict) -> None:
    """Load weights and optimizer state from a checkpoint ``reader`` (atoll.core.checkpoint), cut
    for this worker's island rank where ``cuts`` says; a ZeRO replica keeps its shards of them."""
    rank, ranks = ex.island_rank, ex.island_size

    def local(key: str, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """``key`` cut as parameter or buffer ``name`` (of ``shape``) is held here; a 0-d state
        (a step count) as it is."""
        full = reader.full(key, name)
        if full.dim() == 0:
            return full.clone()
        value = cuts[name].local(full, rank, ranks) if name in cuts else full
        if value.shape != shape:
            raise InvalidInput(f"checkpoint {key} has shape {list(full.shape)}, this job holds {list(shape)}")
        return value.to(dtype).clone()

    def optimizer_state(name: str, shape: torch.Size, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        prefix = f"optim/{name}/"
        keys = {k.removeprefix(prefix): k for k in reader.where if k.startswith(prefix)}
        return {key: local(k, name, shape, dtype) for key, k in keys.items()}

    sharded = {id(p): i for i, p in enumerate(ex.zero.params)} if ex.zero is not None else {}
    zero_params, zero_state = [None] * len(sharded), [None] * len(sharded)
    with torch.no_grad():
        for stage in ex.stages.values():
            for name, p in stage.graph.named_parameters():
                if id(p) in ex.base:
                    continue
                if id(p) in sharded:  # loaded below, as this replica's shards
                    i = sharded[id(p)]
                    shape = ex.zero.shapes[i]
                    zero_params[i] = local(f"param/{name}", name, shape, ex.zero.dtype)
                    zero_state[i] = optimizer_state(name, shape, ex.zero.dtype)
                    continue
                p.copy_(local(f"param/{name}", name, p.shape, p.dtype))
                state = optimizer_state(name, p.shape, p.dtype) if ex.optimizer is not None else {}
                if state:
                    ex.optimizer.state[p] = state
            for name, b in stage.graph.named_buffers():
                b.copy_(local(f"buffer/{name}", name, b.shape, b.dtype))
    if ex.zero is not None:
        keys = set(zero_state[0])
        if any(set(st) != keys for st in zero_state):
            raise InvalidInput("the checkpoint's optimizer state differs between parameters of one rank")
        ex.zero.load(zero_params, {key: [st[key] for st in zero_state] for key in keys})
