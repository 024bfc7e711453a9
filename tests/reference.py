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
    assert len(losses) == len(ref_losses)
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: loss {a} vs reference {b}"
    assert state.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        assert state[name].shape == ref.shape and state[name].dtype == ref.dtype, name
        err = relative_error(state[name], ref)
        assert err <= rtol, f"{name}: relative error {err:.2e} > {rtol}"


def assert_matches_but_key_bias_noise(
    losses, state, model, batches, loss_fn, microbatches: int, adamw_args: dict
) -> None:
    """Every loss, and every weight but one slice, at 1e-5, for GPT-2 from transformers with
    AdamW. The slice is the attention's key bias (the middle third of each ``c_attn.bias``): its
    exact gradient is zero (softmax ignores a shift shared by a row), so what any run computes for
    it is rounding noise, which AdamW normalizes into steps of its own. The single-process run
    moves it as much when only its summation order changes (twice the microbatches: about 7e-5
    relative on ``c_attn.bias``, every other weight within 1e-6), so that slice is held to the
    reference's own spread instead: within 10x of what the two reference runs differ by there
    (measured under TP=2: 1.6x to 2.9x, about 1e-6; a wrong gradient would move it by AdamW's lr)."""
    ref_losses, ref_state = train_reference(model, batches, loss_fn, microbatches, "adamw", adamw_args)
    _, reordered = train_reference(model, batches, loss_fn, 2 * microbatches, "adamw", adamw_args)
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: loss {got} vs reference {want}"
    assert state.keys() == ref_state.keys()
    for name, want in ref_state.items():
        got = state[name]
        if name.endswith("attn.c_attn.bias"):
            keys = slice(want.shape[0] // 3, 2 * want.shape[0] // 3)
            spread = (reordered[name][keys] - want[keys]).abs().max().item()
            error = (got[keys] - want[keys]).abs().max().item()
            assert 0 < spread and error <= 10 * spread, f"{name} key bias: off by {error:.1e}, own spread {spread:.1e}"
            got, want = (
                torch.cat([got[: keys.start], got[keys.stop :]]),
                torch.cat([want[: keys.start], want[keys.stop :]]),
            )
        assert relative_error(got, want) <= 1e-5, name
    own = max(relative_error(reordered[n], ref_state[n]) for n in ref_state if n.endswith("c_attn.bias"))
    assert own > 1e-5  # the reference itself misses the 1e-5 bar on this tensor
