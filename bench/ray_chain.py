"""The tiny pipeline of bench/dispatch.py on Ray Compiled Graphs, the peer for its per-step cost:
one actor per stage holding its Linear layer, chained in a compiled graph (``experimental_compile``:
channels allocated once, no task submission per step). Needs ``ray`` (the ``bench`` extra);
bench/dispatch.py runs it beside atoll when ray is importable.

A training step is the forward chain, the loss and its backward on the last actor, then the
backward chain back to the first actor, each actor applying SGD to its own layer: the same
arithmetic as atoll's tiny 1-microbatch 4-stage job.
"""

from __future__ import annotations

import statistics
import time

import ray
import torch
import torch.nn.functional as F
from ray.dag import InputNode
from torch import nn

LR = 1e-3  # torch.optim.SGD's default, what atoll's job uses


@ray.remote(num_cpus=0)  # four actors on a two-core machine, as atoll's four workers
class Stage:
    def __init__(self, layer: nn.Linear):
        torch.set_num_threads(1)
        self.layer = layer
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.layer(x)

    def train_forward(self, x: torch.Tensor) -> torch.Tensor:
        self.x = x.detach().requires_grad_(True)
        self.y = self.layer(self.x)
        return self.y.detach()

    def loss_backward(self, x: torch.Tensor, target: torch.Tensor) -> tuple[float, torch.Tensor]:
        self.train_forward(x)
        loss = F.mse_loss(self.y, target)
        return float(loss), self._backward_and_step(loss, None)

    def backward(self, packet: tuple[float, torch.Tensor]) -> tuple[float, torch.Tensor]:
        loss, grad = packet
        return loss, self._backward_and_step(self.y, grad)

    def _backward_and_step(self, out: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
        out.backward(grad)
        with torch.no_grad():
            for p in self.layer.parameters():
                p -= LR * p.grad
                p.grad = None
        return self.x.grad


def tiny_pipeline(model: nn.Sequential, x: torch.Tensor, iters: int) -> dict:
    """Median milliseconds of a forward round trip and of a training step through one actor per
    layer of ``model``, and the losses of the first three steps, on a local Ray started (and
    stopped) here."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        actors = [Stage.remote(layer) for layer in model]
        with InputNode() as batch:
            h = batch
            for actor in actors:
                h = actor.forward.bind(h)
        forward = h.experimental_compile()
        forward_ms = _median_ms(lambda: ray.get(forward.execute(x)), iters)
        forward.teardown()
        with InputNode() as batch:
            h = batch[0]
            for actor in actors[:-1]:
                h = actor.train_forward.bind(h)
            h = actors[-1].loss_backward.bind(h, batch[1])
            for actor in reversed(actors[:-1]):
                h = actor.backward.bind(h)
        train = h.experimental_compile()
        first_losses = [ray.get(train.execute(x, x))[0] for _ in range(3)]
        train_ms = _median_ms(lambda: ray.get(train.execute(x, x)), iters)
        train.teardown()
        return {"forward_ms": forward_ms, "train_step_ms": train_ms, "first_losses": first_losses}
    finally:
        ray.shutdown()


def _median_ms(run, iters: int) -> float:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times[iters // 10 :]) * 1e3, 3)  # the first ones warm up
