"""Linear layers' weight gradients added in place (atoll.core.linear_grads), in one process: the
same gradients as autograd's backward (float64, 1e-12) over two accumulating backwards, for the
layers torch runs as ``addmm``/``mm`` (2-D and 3-D inputs, with and without bias); a tied, a
frozen and a first-stage first layer left to autograd; the executor fusing a wide stage (and
not a narrow one) while matching PyTorch step for step; and the data-parallel buckets taking the
gradients added in place as they come."""

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from atoll.core import linear_grads
from atoll.worker.executor.buckets import GradBuckets
from tests.test_action_kinds import _compiled, _executor


class Tied(nn.Module):
    """One weight in two layers: neither product may add it alone."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _chain(bias=True):
    return nn.Sequential(
        nn.Linear(8, 16, bias=bias), nn.GELU(), nn.Linear(16, 16, bias=bias), nn.Tanh(), nn.Linear(16, 4)
    )


def _frozen():
    model = _chain()
    model[2].weight.requires_grad_(False)  # a frozen base weight (LoRA's): its bias still learns
    return model


# (name, model, input shape, whether the input needs a gradient, leaves: None or "weights", fused layers)
CASES = [
    ("chain", _chain, (6, 8), True, None, 3),
    ("3-D input", _chain, (2, 3, 8), True, None, 3),
    ("no bias", lambda: _chain(bias=False), (6, 8), True, None, 3),
    ("first stage", _chain, (6, 8), False, None, 2),
    ("weights only", _chain, (6, 8), True, "weights", 2),
    ("tied", Tied, (6, 8), True, None, 0),
    ("frozen weight", _frozen, (6, 8), True, None, 2),
]


@pytest.mark.parametrize(
    ("make", "shape", "input_grad", "leaves", "fused"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_fused_backward_gives_autograd_gradients(make, shape, input_grad, leaves, fused):
    torch.manual_seed(0)
    model = make().double()
    twin = copy.deepcopy(model)
    weights = [p for p in twin.parameters() if p.requires_grad]
    for _ in range(2):  # the second adds to the first's gradients (addmm_ into .grad)
        x = torch.randn(*shape, dtype=torch.float64, requires_grad=input_grad)
        x_twin = x.detach().clone().requires_grad_(input_grad)
        out = model(x)
        grad = torch.randn_like(out)
        if leaves is None:
            torch.autograd.backward([out], [grad])
        else:
            torch.autograd.backward([out], [grad], inputs=[p for p in model.parameters() if p.requires_grad])
        out_twin = twin(x_twin)
        linears, rest = linear_grads.plan([out_twin], None if leaves is None else weights)
        assert len(linears) == fused
        assert not {id(t) for lin in linears for t in (lin.weight, lin.bias)} & {id(t) for t in rest}
        linear_grads.backward([out_twin], [grad], None if leaves is None else weights)
        if leaves is None and input_grad:
            torch.testing.assert_close(x_twin.grad, x.grad, rtol=1e-12, atol=1e-12)
        elif input_grad:
            assert x_twin.grad is None  # only the weights were asked for
    for (name, ref), got in zip(model.named_parameters(), twin.parameters()):
        assert (ref.grad is None) == (got.grad is None), name
        if ref.grad is not None:
            assert got.grad.stride() == ref.grad.stride(), name
            torch.testing.assert_close(got.grad, ref.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_a_layer_autograd_has_no_work_under_is_left_to_it():
    """A first stage's first layer: its input needs no gradient, so its product node would not
    run for a pre-hook to fire; its weight stays with autograd, the layer above is fused."""
    model = _chain().double()
    out = model(torch.randn(6, 8, dtype=torch.float64))
    linears, rest = linear_grads.plan([out], None)
    assert {id(lin.weight) for lin in linears} == {id(model[2].weight), id(model[4].weight)}
    assert {id(t) for t in rest} == {id(model[0].weight), id(model[0].bias)}


def _wide(width):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3)
    ).double()


@pytest.mark.parametrize(("width", "fused_per_backward"), [(256, 2), (8, 0)], ids=["wide", "narrow"])
def test_the_executor_fuses_a_wide_stage_and_matches_pytorch(monkeypatch, width, fused_per_backward):
    """A stage with a matrix of ``MIN_WEIGHT_ELEMENTS`` (256 x 256) fuses its layers but the
    first (its input needs no gradient); a narrow one keeps autograd's backward. AdamW, float64,
    1e-12 against PyTorch over three steps of two microbatches."""
    assert 256 * 256 >= linear_grads.MIN_WEIGHT_ELEMENTS > 8 * 8
    calls = []
    accumulate = linear_grads.Linear.accumulate
    counted = lambda self, g, ready=None: calls.append(1) or accumulate(self, g, ready)  # noqa: E731
    monkeypatch.setattr(linear_grads.Linear, "accumulate", counted)
    model = _wide(width)
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    compiled = _compiled(model, x, y)
    executor = _executor(compiled, compiled.lowered.actions[0])
    opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        xb = torch.randn(8, 6, generator=data, dtype=torch.float64)
        yb = torch.randn(8, 3, generator=data, dtype=torch.float64)
        losses, _, _ = executor.run_step([xb], [yb], step=step)
        opt.zero_grad()
        want = [F.mse_loss(reference(xm), ym) for xm, ym in zip(xb.chunk(2), yb.chunk(2))]
        (sum(want) / 2).backward()
        opt.step()
        assert losses == pytest.approx([w.item() for w in want], rel=0, abs=1e-12)
    assert len(calls) == fused_per_backward * 2 * 3
    got = executor.state_dict()
    for name, want in reference.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=0, atol=1e-12)


def test_a_node_without_the_saved_values_this_code_reads_is_left_to_autograd():
    """Another torch might name a product node's saved values otherwise: no fusing, no error."""
    node = type("AddmmBackward0", (), {"next_functions": ()})()
    assert linear_grads.find(node, {}, {}) is None


class _RecordingGroup:
    """A replica group's all-reduce as the buckets call it, recording which gradients each got."""

    world_size = 2

    def __init__(self):
        self.reduced: list[torch.Tensor] = []

    def all_reduce_sum(self, tensors):
        self.reduced += tensors
        return type("Done", (), {"wait": lambda self, timeout_s: None})()


@pytest.mark.parametrize("tell", [True, False], ids=["ready", "without"])
def test_in_place_gradients_reach_the_data_parallel_buckets_during_the_last_backward(tell):
    """The buckets take each final gradient as its stage's last backward of the step adds it:
    autograd's hook for the leaves it keeps, ``ready`` for the layers added in place. Without
    ``ready`` those wait for ``finish`` (no overlap with the backward); either way each gradient
    is reduced once."""
    model = _wide(256)
    params = list(model.parameters())
    group = _RecordingGroup()
    buckets = GradBuckets({0: params}, set(), group, 10.0)
    x = torch.randn(8, 6, dtype=torch.float64)
    fused = {id(t) for lin in linear_grads.plan([model(x).sum()], None)[0] for t in (lin.weight, lin.bias)}
    assert fused == {id(t) for i in (2, 4) for t in (model[i].weight, model[i].bias)}  # not the first layer
    for last in (False, True):  # two microbatches; the second is the stage's last backward
        with buckets.last_backward(0) if last else contextlib.nullcontext():
            linear_grads.backward([model(x).sum()], None, None, buckets.ready if tell else None)
    during = {id(g) for g in group.reduced}
    buckets.finish()
    assert sorted(id(g) for g in group.reduced) == sorted(id(p.grad) for p in params)  # each once
    assert all((id(p.grad) in during) is tell for p in params if id(p) in fused)
    assert {id(p.grad) for p in params if id(p) not in fused} <= during  # autograd's hook
