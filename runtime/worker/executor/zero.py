"""ZeRO stage 1 (Rajbhandari et al., 2020) for one pipeline rank of a data-parallel job.

The rank's parameters are moved into one flat buffer (each parameter becomes a view of it),
padded to a multiple of the replica count D and cut into D equal shards. Replica ``d`` keeps
optimizer state for shard ``d`` only: 1/D of what plain data parallelism keeps. Each step,
``reduce`` packs the gradients into one flat buffer (each gradient becomes a view of it, so the
accounting counts it once) and averages it across the replicas; ``step`` runs the optimizer on
shard ``d`` alone and all-gathers the shards back into every replica's buffer, so every replica
holds the same full parameters again. The optimizers atoll offers (SGD, Adam, AdamW) update each
element from its own gradient and state only, so stepping a shard of the flat buffer is the
same arithmetic as stepping the parameters one by one.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from atoll.core.optim import build_optimizer


class ZeroShard:
    def __init__(self, params: list[nn.Parameter], replica: int, replicas: int, optimizer: str, args: dict):
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"zero=1 needs one parameter dtype per rank, found {sorted(map(str, dtypes))}")
        self.params = params
        self.replica, self.replicas = replica, replicas
        total = sum(p.numel() for p in params)
        self.shard = math.ceil(total / replicas)
        self.flat = torch.zeros(self.shard * replicas, dtype=dtypes.pop(), device=params[0].device)
        self.spans = []
        offset = 0
        for p in params:
            n = p.numel()
            self.flat[offset : offset + n].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset : offset + n].view_as(p)
            self.spans.append((offset, n))
            offset += n
        self.mine = nn.Parameter(self._piece(self.flat, replica))  # a view: stepping it updates the buffer
        self.optimizer = build_optimizer(optimizer, [self.mine], args)

    def _piece(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        return flat[index * self.shard : (index + 1) * self.shard]

    def reduce(self, group, timeout_s: float) -> int:
        """Average the gradients across the replicas into one flat buffer; returns its bytes."""
        grad = torch.zeros_like(self.flat)
        for p, (offset, n) in zip(self.params, self.spans):
            if p.grad is not None:  # a parameter without a gradient reduces as zeros
                grad[offset : offset + n].copy_(p.grad.reshape(-1))
            p.grad = grad[offset : offset + n].view_as(p)  # the separate gradient is freed here
        group.all_reduce_sum([grad]).wait(timeout_s)
        grad.div_(self.replicas)
        self.mine.grad = self._piece(grad, self.replica)
        return grad.nbytes

    def step(self, group, timeout_s: float) -> None:
        """Step this replica's shard, then gather every replica's shard into the buffer."""
        self.optimizer.step()
        own = self._piece(self.flat, self.replica).clone()  # gloo reads the input while writing outputs
        outputs = [self._piece(self.flat, d) for d in range(self.replicas)]
        group.all_gather(outputs, own).wait(timeout_s)

    def zero_grad(self) -> None:
        self.mine.grad = None
        for p in self.params:
            p.grad = None
