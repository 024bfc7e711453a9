"""ZeRO stages 1, 2 and 3 (Rajbhandari et al., 2020) for one pipeline rank of a data-parallel job.

The rank's trainable parameters are laid out in one flat buffer, padded to a multiple of the
replica count D and cut into D equal shards; replica ``d`` owns shard ``d`` and keeps optimizer
state for it alone (``mine``). The optimizers atoll offers (SGD, Adam, AdamW) update each element
from its own gradient and state only, so stepping a shard of the flat buffer is the same
arithmetic as stepping the parameters one by one.

- Stage 1: every parameter is a view of the flat buffer, which every replica holds whole. At the
  end of the backward the gradients are packed into one flat buffer (each gradient then a view of
  it) and all-reduced; the optimizer steps shard ``d``, and the shards are all-gathered back.
- Stage 2: as stage 1, but the packed gradients are reduce-scattered: each replica keeps only its
  shard's average, and the full gradients are freed before the optimizer step.
- Stage 3: a replica holds only its shard of the parameters between steps. ``gather`` (the plan's
  GATHER_PARAMS action, first in every step) all-gathers the flat buffer and points every
  parameter into it; after the reduce-scatter of the last backward the buffer is freed, and the
  optimizer steps the shard, which is all the next step gathers from. A pipeline rank gathers
  once per step, not once per microbatch: its stages run the step's microbatches interleaved, so
  the parameters are read from the first forward to the last backward (FSDP2 with
  ``reshard_after_forward=False`` under gradient accumulation, per pipeline rank).

Gloo has a reduce-scatter (``ProcessGroupGloo.reduce_scatter``), used as is.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from atoll.core.memory import storage_bytes
from atoll.core.optim import build_optimizer


class ZeroShard:
    def __init__(
        self, params: list[nn.Parameter], replica: int, replicas: int, optimizer: str, args: dict, stage: int = 1
    ):
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"zero={stage} needs one parameter dtype per rank, found {sorted(map(str, dtypes))}")
        self.stage = stage
        self.params = params
        self.shapes = [p.shape for p in params]
        self.replica, self.replicas = replica, replicas
        total = sum(p.numel() for p in params)
        self.shard = math.ceil(total / replicas)
        flat = torch.zeros(self.shard * replicas, dtype=dtypes.pop(), device=params[0].device)
        self.spans = []
        offset = 0
        for p in params:
            n = p.numel()
            flat[offset : offset + n].copy_(p.detach().reshape(-1))
            self.spans.append((offset, n))
            offset += n
        self.flat: torch.Tensor | None = None
        """The whole flat buffer while this replica holds it (always below stage 3)."""
        if stage < 3:
            self._point_into(flat)
            self.mine = nn.Parameter(self._piece(flat, replica))  # a view: stepping it updates the buffer
        else:
            self.mine = nn.Parameter(self._piece(flat, replica).clone())
            self.release()
        self.optimizer = build_optimizer(optimizer, [self.mine], args)

    def _piece(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        return flat[index * self.shard : (index + 1) * self.shard]

    def _point_into(self, flat: torch.Tensor) -> None:
        self.flat = flat
        for p, (offset, n), shape in zip(self.params, self.spans, self.shapes):
            p.data = flat[offset : offset + n].view(shape)

    @property
    def parameter_bytes(self) -> int:
        """What this replica holds of the parameters now (stage 3: its shard, and the whole
        buffer while gathered)."""
        held = [self.flat] if self.flat is not None else []
        return storage_bytes([*held, self.mine] if self.stage == 3 else held)

    @property
    def gradient_bytes(self) -> int:
        return storage_bytes([*(p.grad for p in self.params), self.mine.grad])

    def gather(self, group, timeout_s: float) -> int:
        """Stage 3: every replica's shard into a whole flat buffer, the parameters pointing into
        it; returns the bytes gathered (0 when already held: a step that failed before its
        reduce left it so)."""
        if self.flat is not None:
            return 0
        flat = torch.empty(self.shard * self.replicas, dtype=self.mine.dtype, device=self.mine.device)
        pieces = [self._piece(flat, d) for d in range(self.replicas)]
        group.all_gather(pieces, self.mine.detach()).wait(timeout_s)
        self._point_into(flat)
        return flat.nbytes

    def release(self) -> None:
        """Stage 3: drop the whole buffer; the parameters keep their shapes' names, no storage."""
        empty = torch.empty(0, dtype=self.mine.dtype, device=self.mine.device)
        for p in self.params:
            p.data = empty
        self.flat = None

    def reduce(self, group, timeout_s: float) -> int:
        """Average the gradients across the replicas (stage 1: all of them, each replica keeping
        the whole average; stages 2 and 3: each replica receiving its shard's); returns the bytes
        of the packed gradient buffer."""
        grad = torch.zeros(self.shard * self.replicas, dtype=self.mine.dtype, device=self.mine.device)
        for p, (offset, n) in zip(self.params, self.spans):
            if p.grad is not None:  # a parameter without a gradient reduces as zeros
                grad[offset : offset + n].copy_(p.grad.reshape(-1))
            # stage 1 keeps a view of the average; the separate gradient is freed here either way
            p.grad = grad[offset : offset + n].view_as(p) if self.stage == 1 else None
        if self.stage == 1:
            group.all_reduce_sum([grad]).wait(timeout_s)
            grad.div_(self.replicas)
            own = self._piece(grad, self.replica)
        else:
            own = torch.empty(self.shard, dtype=grad.dtype, device=grad.device)
            pieces = [self._piece(grad, d) for d in range(self.replicas)]
            group.reduce_scatter(own, pieces).wait(timeout_s)
            own.div_(self.replicas)
        self.mine.grad = own
        if self.stage == 3:
            self.release()
        return grad.nbytes

    def step(self, group, timeout_s: float) -> None:
        """Step this replica's shard; below stage 3, gather every replica's shard into the buffer."""
        self.optimizer.step()
        if self.stage == 3:
            return  # the next step gathers
        own = self._piece(self.flat, self.replica).clone()  # gloo reads the input while writing outputs
        outputs = [self._piece(self.flat, d) for d in range(self.replicas)]
        group.all_gather(outputs, own).wait(timeout_s)

    def _gathered(self, shard: torch.Tensor, group, timeout_s: float) -> torch.Tensor:
        """Every replica's ``shard`` (of the flat layout) in one whole flat tensor."""
        flat = torch.empty(self.shard * self.replicas, dtype=shard.dtype, device=shard.device)
        group.all_gather([self._piece(flat, d) for d in range(self.replicas)], shard.detach()).wait(timeout_s)
        return flat

    def _unpack(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[offset : offset + n].view(shape).clone() for (offset, n), shape in zip(self.spans, self.shapes)]

    def _pack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros(self.shard * self.replicas, dtype=tensors[0].dtype, device=self.mine.device)
        for t, (offset, n) in zip(tensors, self.spans):
            flat[offset : offset + n].copy_(t.reshape(-1))
        return flat

    def export(self, group, timeout_s: float) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
        """The whole parameters, and the optimizer state per parameter as an unsharded job keeps
        it (a checkpoint's layout, which any other layout can load). Every replica calls it:
        the shards are gathered in the optimizer state's order, the same on each."""
        params = self._unpack(self.flat if self.flat is not None else self._gathered(self.mine, group, timeout_s))
        state = {}
        for key, value in self.optimizer.state.get(self.mine, {}).items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"optimizer state {key!r} is a {type(value).__name__}, not a tensor")
            if value.dim() == 0:  # a step count: each parameter's own, all equal
                state[key] = [value.clone() for _ in params]
            else:
                state[key] = self._unpack(self._gathered(value, group, timeout_s))
        return params, state

    def load(self, params: list[torch.Tensor], state: dict[str, list[torch.Tensor]]) -> None:
        """The inverse of ``export``: this replica keeps its shard of what it is given."""
        flat = self._pack(params)
        with torch.no_grad():
            if self.stage == 3:
                self.mine.copy_(self._piece(flat, self.replica))
            else:
                self.flat.copy_(flat)  # ``mine`` is a view of it
        self.optimizer.state[self.mine] = {
            key: values[0].clone() if values[0].dim() == 0 else self._piece(self._pack(values), self.replica).clone()
            for key, values in state.items()
        }

    def end_step(self) -> None:
        """Drop the step's gradients and, at stage 3, parameters still gathered (an evaluation or
        forward step, which reduces nothing, or a step that failed before its reduction)."""
        self.mine.grad = None
        for p in self.params:
            p.grad = None
        if self.stage == 3 and self.flat is not None:
            self.release()
