"""The split backward's analysis kept across microbatches (atoll.core.split_layouts): analysed
once while a stage's graph keeps its shape, the halves still give exactly the full backward's
gradients, on other weights too where they are listed in the same order; a graph of another
shape, or weights listed in another order, is analysed afresh."""

import copy

import pytest
import torch
from torch import nn

from atoll.core.split_backward import analyse, backward_input, backward_weight
from atoll.core.split_layouts import Layouts
from tests.test_split_backward import CASES, NormedBlock, _outputs


def _run(model, layouts, inputs, grads, weights=None):
    """One microbatch's two halves, with ``layouts`` (``weights``: the model's parameters, in this
    order); the groups' kinds (linear, direct), None where the half did not split."""
    weights = weights or list(model.parameters())
    half = backward_input(_outputs(model, inputs), grads, inputs, weights, layouts)
    kinds = None if half.groups is None else [(g.linear is not None, g.direct is not None) for g in half.groups]
    backward_weight(half, weights)
    return kinds


CASES_AND_BLOCK = [*CASES, (NormedBlock, 1, True)]


@pytest.mark.parametrize(("make", "n_inputs", "split"), CASES_AND_BLOCK, ids=[c[0].__name__ for c in CASES_AND_BLOCK])
@pytest.mark.parametrize("first_stage", [False, True], ids=["inner", "first"])
def test_kept_analysis_gives_the_full_backward_over_microbatches(make, n_inputs, split, first_stage):
    torch.manual_seed(0)
    model = make().double()
    twin = copy.deepcopy(model)
    layouts = Layouts()
    fresh = None
    for _ in range(3):
        inputs = [torch.randn(4, 8, dtype=torch.float64, requires_grad=not first_stage) for _ in range(n_inputs)]
        grads = [torch.randn_like(o) for o in _outputs(model, inputs)]
        torch.autograd.backward(_outputs(model, inputs), grads)
        twin_inputs = [t.detach().clone().requires_grad_(not first_stage) for t in inputs]
        if fresh is None and not first_stage:  # what a fresh analysis finds, to compare the kept one with
            roots = [o.grad_fn for o in _outputs(twin, twin_inputs)]
            groups = analyse(roots, twin_inputs, list(twin.parameters()))
            fresh = None if groups is None else [(g.linear is not None, g.direct is not None) for g in groups]
        kinds = _run(twin, layouts, twin_inputs, grads)
        assert (kinds is not None) == (split and not first_stage)
        assert kinds == fresh
        for ref, got in zip(inputs, twin_inputs):
            if ref.grad is not None:
                assert torch.equal(ref.grad, got.grad)
    assert layouts.analysed == (0 if first_stage else 1)  # a first stage's inputs need no gradient: no analysis
    for (name, ref), got in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-12, atol=1e-12, msg=name)


def _full_and_split(model, twin, layouts, weights=None):
    """``model``'s full backward against ``twin``'s halves with ``layouts``, gradients zeroed first."""
    for p in [*model.parameters(), *twin.parameters()]:
        p.grad = None
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(4, 8, dtype=torch.float64)
    torch.autograd.backward([model(x)], [grad])
    x_twin = x.detach().clone().requires_grad_()
    _run(twin, layouts, [x_twin], [grad], weights)
    assert torch.equal(x.grad, x_twin.grad)
    for (name, ref), got in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_another_shape_or_other_weights_are_analysed_afresh():
    torch.manual_seed(0)
    layouts = Layouts()
    chain = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)).double()
    twin = copy.deepcopy(chain)
    _full_and_split(chain, twin, layouts)
    _full_and_split(chain, twin, layouts)
    assert layouts.analysed == 1
    # the same shape on other weights, listed in the same order: what was found by position
    # holds, the gradients land on these weights
    other = copy.deepcopy(chain)
    _full_and_split(chain, other, layouts)
    assert layouts.analysed == 1
    # the weights listed in another order: the kept indices no longer name the tensors there
    _full_and_split(chain, other, layouts, list(other.parameters())[::-1])
    assert layouts.analysed == 2
    # another shape (a tanh for the GELU)
    _full_and_split(nn.Sequential(chain[0], nn.Tanh(), chain[2]), nn.Sequential(twin[0], nn.Tanh(), twin[2]), layouts)
    assert layouts.analysed == 3
