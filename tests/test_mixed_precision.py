"""Mixed precision (``precision="bf16"``): every stage computes under torch.autocast to bfloat16
with float32 parameters, gradients, reductions and optimizer state, and tensors cross between
stages in bfloat16. The reference is one process under the same policy: the same autocast, the
same microbatches, and the same rounding to bfloat16 where the pipeline cuts (activations going
forward, their gradients coming back). Losses within 1e-3 relative over 20 steps."""

import copy

import pytest
import torch

import atoll
from atoll.core.optim import OPTIMIZERS
from tests import models

pytestmark = pytest.mark.cluster  # every test here starts processes

ARGS = {"lr": 3e-3}
STEPS = 20
BF16_RTOL = 1e-3
CUT = 3  # before the model's 4th child: Embedding, 2 blocks | 2 blocks, Head


class _Wire(torch.autograd.Function):
    """A stage boundary under mixed precision: bfloat16 both ways."""

    @staticmethod
    def forward(ctx, x):
        return x.to(torch.bfloat16).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(torch.bfloat16).to(grad.dtype)


def _reference(model, batches, microbatches: int, device: str = "cpu") -> list[float]:
    model = copy.deepcopy(model).to(device)
    opt = OPTIMIZERS["adamw"](model.parameters(), **ARGS)
    losses = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in batches[step % len(batches)])
        total = 0.0
        for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = models.lm_loss(model[CUT:](_Wire.apply(model[:CUT](xm))), ym)
            (loss / microbatches).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / microbatches)
    return losses


def _train(client, model, batches, precision: str, steps: int = STEPS, **layout):
    """``layout``: the job's other settings (data_parallel, zero, device)."""
    x, y = batches[0]
    job = client.pipeline(
        model, example_input=x, example_target=y, loss_fn=models.lm_loss, stages=2, microbatches=2,
        split_points=[CUT], schedule="1f1b", optimizer="adamw", optimizer_args=ARGS, precision=precision, **layout,
    )  # fmt: skip
    try:
        losses = [job.step(*batches[i % len(batches)]) for i in range(steps)]
        return job, losses, job.last.memory
    finally:
        job.close()


@pytest.mark.parametrize(
    "layout", [{}, {"data_parallel": 2, "zero": 3}], ids=["pp2", "pp2xdp2-zero3"]
)  # fmt: skip
def test_bf16_matches_the_same_policy_in_one_process(client4, layout):
    model, batches, _ = models.transformer()
    job, losses, memory = _train(client4, model, batches, "bf16", **layout)
    expected = _reference(model, batches, 2 * layout.get("data_parallel", 1))
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
    assert worst <= BF16_RTOL, (worst, losses, expected)
    assert sum(losses[-5:]) < 0.95 * sum(losses[:5]), losses  # it trains: 3.31 -> 2.99 here
    for w, m in memory.items():  # bytes and memory as the plan says, with bfloat16 on the wire
        rank = w % 2
        assert m["data_plane_bytes"] == job.plan.predicted_communication[rank]
        assert m["peak"]["total"] == job.plan.predicted_memory[rank]["total"], (w, m["peak"])


def test_bf16_halves_the_bytes_between_stages(client4):
    model, batches, _ = models.transformer()
    moved = {}
    for precision in ("fp32", "bf16"):
        _, _, memory = _train(client4, model, batches, precision, steps=1)
        moved[precision] = [memory[w]["data_plane_bytes"] for w in (0, 1)]
    for full, half in zip(moved["fp32"], moved["bf16"]):
        assert full["sent"] > 0 and half["sent"] * 2 == full["sent"] and half["received"] * 2 == full["received"]


def test_fp16_and_unknown_precisions_are_refused_with_the_reason(client4):
    model, batches, _ = models.transformer()
    x, y = batches[0]
    settings = dict(example_input=x, example_target=y, loss_fn=models.lm_loss, stages=2, microbatches=2)
    with pytest.raises(atoll.InvalidInput, match='"fp16" needs dynamic loss scaling.*use "bf16"'):
        client4.pipeline(model, precision="fp16", **settings)
    with pytest.raises(atoll.InvalidInput, match='precision must be "fp32" or "bf16"'):
        client4.pipeline(model, precision="int8", **settings)
    assert all(not w.jobs for w in client4.status().workers)
