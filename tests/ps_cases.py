"""Models, batches and the single-process reference of the parameter-server tests and bench."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn


class Recommender(nn.Module):
    """An embedding table (the sparse part) and a small MLP on the mean of a row's ids."""

    def __init__(self, rows: int = 1000, dim: int = 8, classes: int = 4):
        super().__init__()
        self.table = nn.Embedding(rows, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 16), nn.Tanh(), nn.Linear(16, classes))

    def forward(self, ids):
        return self.mlp(self.table(ids).mean(1))


def mlp(width: int = 16, classes: int = 4) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, classes))


def dense_batches(rounds: int, tasks: int, batch: int = 8, width: int = 16, seed: int = 1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [
        [
            (torch.randn(batch, width, generator=g, dtype=dtype), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(tasks)
        ]
        for _ in range(rounds)
    ]


def id_batches(rounds: int, tasks: int, rows: int, batch: int = 8, ids: int = 5, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        [
            (torch.randint(0, rows, (batch, ids), generator=g), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(tasks)
        ]
        for _ in range(rounds)
    ]


def synchronous_reference(model: nn.Module, rounds, optimizer: str, lr: float, weight_decay: float = 0.0):
    """Sequential consistency in one process: per round, every task's loss on its batch, one
    optimizer step on the mean of their gradients. (losses per round per task, state dict)."""
    model = copy.deepcopy(model)
    make = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[optimizer]
    opt = make(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for batches in rounds:
        each = [F.cross_entropy(model(x), y) for x, y in batches]
        (sum(each) / len(each)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append([loss.item() for loss in each])
    return losses, model.state_dict()
