"""The single-process reference every parallel mode is compared with."""

from __future__ import annotations

import copy

import torch

from atoll.core.optim import OPTIMIZERS

# A pipeline runs the same ATen kernels in a different process; what may differ is the order of
# floating-point accumulation (per-microbatch backward, gradient sums), so results agree to a
# small relative error, not bit for bit.
RTOL = 1e-5


def train_reference(model, batches, loss_fn, microbatches: int, optimizer: str, optimizer_args: dict):
    """Per step: mean of per-microbatch losses, backward of that mean, one optimizer step."""
    model = copy.deepcopy(model)
    opt = OPTIMIZERS[optimizer](model.parameters(), **optimizer_args)
    losses = []
    for x, y in batches:
        mb_losses = [loss_fn(model(xm), ym) for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches))]
        loss = sum(mb_losses) / microbatches
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model.state_dict()


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error ||got - ref|| / ||ref|| (absolute error when ref is all zeros)."""
    got, ref = got.double(), ref.double()
    scale = ref.norm().item()
    diff = (got - ref).norm().item()
    return diff / scale if scale > 0 else diff


def assert_matches_reference(losses, state, ref_losses, ref_state, rtol: float = RTOL) -> None:
    assert_losses_match(losses, ref_losses, rtol)
    assert state.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        assert state[name].shape == ref.shape and state[name].dtype == ref.dtype, name
        err = relative_error(state[name], ref)
        assert err <= rtol, f"{name}: relative error {err:.2e} > {rtol}"


# AdamW parity: AdamW divides a gradient by its own running size, so a gradient whose exact value is
# zero (GPT-2's attention key bias: softmax ignores a shift shared by a row) is stepped on its float32
# rounding noise as if it were signal; two single-process runs that only sum in another order differ
# there by about 7e-5. In float64 the noise is below AdamW's epsilon and the step vanishes. So under
# AdamW the weights are compared in float64 runs, the losses in float32 and float64 runs.
def assert_losses_match(losses, ref_losses, rtol: float = RTOL) -> None:
    assert len(losses) == len(ref_losses)
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: loss {a} vs reference {b}"
