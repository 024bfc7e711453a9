"""The split backward of zero-bubble schedules (atoll.core.split_backward), in one process: the
input half gives exactly the input gradients and no weight gradient, the weight half then gives
exactly the weight gradients, for the shapes a stage takes (a chain, a skip, a weight whose path
only meets the inputs' late, a first stage, two inputs, an output no input reaches)."""

import copy

import pytest
import torch
from torch import nn

from atoll.core import split_backward
from atoll.core.memory import storage_key
from atoll.core.split_backward import backward_input, backward_weight, held_bytes


class Skip(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.scale = nn.Linear(8, 8), nn.Linear(8, 8), nn.Parameter(torch.randn(8))

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(h) + h * self.scale + x


class LateWeight(nn.Module):
    """A weight whose own path joins the inputs' only at the last add."""

    def __init__(self):
        super().__init__()
        self.a, self.table = nn.Linear(8, 8), nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        return self.a(x) + self.table.exp()


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x, y):
        return self.norm(self.a(x) * y)


class TwoOutputs(nn.Module):
    """The second output depends on a weight alone: no input's path meets it."""

    def __init__(self):
        super().__init__()
        self.a, self.bias = nn.Linear(8, 8), nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        return self.a(x), self.bias * 2


def _chain():
    return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))


CASES = [  # (model, inputs, whether the weight half starts from kept gradients)
    (_chain, 1, True),
    (Skip, 1, True),
    (LateWeight, 1, True),
    (TwoInputs, 2, True),
    (TwoOutputs, 1, False),
]


def _outputs(model, inputs):
    out = model(*inputs)
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize(("make", "n_inputs", "split"), CASES, ids=[c[0].__name__ for c in CASES])
@pytest.mark.parametrize("first_stage", [False, True], ids=["inner", "first"])
def test_halves_give_exactly_the_full_backward(make, n_inputs, split, first_stage):
    torch.manual_seed(0)
    model = make().double()
    twin = copy.deepcopy(model)
    inputs = [torch.randn(4, 8, dtype=torch.float64, requires_grad=not first_stage) for _ in range(n_inputs)]
    twin_inputs = [t.detach().clone().requires_grad_(not first_stage) for t in inputs]
    outputs = _outputs(model, inputs)
    grads = [torch.randn_like(o) for o in outputs]
    torch.autograd.backward(outputs, grads)

    half = backward_input(_outputs(twin, twin_inputs), grads, twin_inputs, list(twin.parameters()))
    assert (half.groups is not None) == (split and not first_stage)
    for ref, got in zip(inputs, twin_inputs):
        assert (ref.grad is None) == (got.grad is None)
        if ref.grad is not None:
            assert torch.equal(ref.grad, got.grad)
    assert all(p.grad is None for p in twin.parameters())  # the weights wait for their half
    backward_weight(half, list(twin.parameters()))
    for (name, ref), got in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_kept_bytes_are_predicted_on_fake_tensors():
    """What the compiler counts on fake tensors is what a worker counts on real ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    model = _chain()
    names = [n for n, _ in model.named_parameters()]

    def kept_bytes(params):
        x = torch.randn(4, 8, requires_grad=True)
        out = torch.func.functional_call(model, dict(zip(names, params)), (x,))
        grad = torch.zeros_like(out)
        half = backward_input([out], [grad], [x], params)
        return held_bytes(half, [grad], {storage_key(p) for p in params})

    real = kept_bytes(list(model.parameters()))
    with FakeTensorMode() as mode:
        fake = kept_bytes([mode.from_tensor(p) for p in model.parameters()])
    assert real == fake > 0


def test_no_output_gradient_leaves_both_halves_nothing_to_do():
    weight = nn.Parameter(torch.randn(3))
    x = torch.randn(3, requires_grad=True)
    half = backward_input([], [], [x], [weight])
    backward_weight(half, [weight])
    assert x.grad is None and weight.grad is None and half.kept() == []


@pytest.mark.parametrize("first_stage", [False, True], ids=["inner", "first"])
def test_weight_halves_add_linear_gradients_in_place_over_microbatches(first_stage):
    """A chain's linear layers take their weight halves in place (atoll.core.linear_grads): each
    group is one layer, and two microbatches' halves give the full backwards' summed gradients."""
    torch.manual_seed(0)
    model = _chain().double()
    twin = copy.deepcopy(model)
    for _ in range(2):
        x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=not first_stage)
        grad = torch.randn(2, 3, 8, dtype=torch.float64)
        torch.autograd.backward([model(x)], [grad])
        x_twin = x.detach().clone().requires_grad_(not first_stage)
        half = backward_input([twin(x_twin)], [grad], [x_twin], list(twin.parameters()))
        if not first_stage:
            assert [g.linear is not None for g in half.groups] == [True, True]
        backward_weight(half, list(twin.parameters()))
    for (name, ref), got in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-12, atol=1e-12, msg=name)


class NormedBlock(nn.Module):
    """A pre-norm residual block, as a transformer's: layer norms whose weight and bias hang
    straight off their backward node, and linear layers."""

    def __init__(self):
        super().__init__()
        self.norm, self.a, self.b = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(self.norm(x))))


def test_weight_halves_of_a_normed_block_match_over_microbatches_and_record_no_graph():
    """Each group takes the cheapest path (a layer norm's weight and bias from its node called
    directly, a linear layer's in place), two microbatches' halves sum to the full backwards'
    gradients, and, run in grad mode as a training step runs them, the gradients carry no autograd
    graph (one would keep every microbatch's forward graph alive until they are zeroed)."""
    torch.manual_seed(0)
    model = NormedBlock().double()
    twin = copy.deepcopy(model)
    for _ in range(2):
        x = torch.randn(2, 3, 8, dtype=torch.float64)
        grad = torch.randn(2, 3, 8, dtype=torch.float64)
        torch.autograd.backward([model(x.requires_grad_())], [grad])
        x_twin = x.detach().clone().requires_grad_()
        half = backward_input([twin(x_twin)], [grad], [x_twin], list(twin.parameters()))
        assert sorted((g.direct is not None, g.linear is not None) for g in half.groups) == [
            (False, True),
            (False, True),
            (True, False),
        ]
        assert torch.is_grad_enabled()
        backward_weight(half, list(twin.parameters()))
    for (name, ref), got in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-12, atol=1e-12, msg=name)
        assert got.grad.grad_fn is None and not got.grad.requires_grad, name


@pytest.mark.parametrize("through", ["direct", "autograd"])
def test_a_gradient_passed_on_as_given_is_copied_not_taken(monkeypatch, through):
    """An add's backward passes the gradient it is given on as it is: an input and a weight added
    to make a stage's output get the output's gradient itself, a receive buffer the next
    microbatch overwrites. Their ``.grad`` are copies, whichever way the weight half runs."""
    if through == "autograd":
        monkeypatch.setattr(split_backward, "DIRECT_NODES", frozenset())
    x = torch.randn(4, 8, requires_grad=True)
    shift = nn.Parameter(torch.zeros(4, 8))
    grad = torch.randn(4, 8)
    half = backward_input([x + shift], [grad], [x], [shift])
    assert [g.direct is not None for g in half.groups] == [through == "direct"]
    backward_weight(half, [shift])
    assert torch.equal(shift.grad, grad) and torch.equal(x.grad, grad)
    grad.zero_()  # the buffer taken by the next microbatch
    assert shift.grad.abs().sum() > 0 and x.grad.abs().sum() > 0
