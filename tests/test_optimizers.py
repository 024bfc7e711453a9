"""Optimizers by name (runtime/core/optim.py), without processes."""

import pytest
import torch

from atoll.core import optim
from atoll.core.optim import build_optimizer
from atoll.errors import InvalidInput


def _built(name: str, args: dict) -> dict:
    group = build_optimizer(name, [torch.nn.Parameter(torch.zeros(3))], args).param_groups[0]
    return {k: group.get(k) for k in ("foreach", "fused")}


def test_parameters_step_together_unless_the_job_says_otherwise():
    assert _built("adamw", {"lr": 1e-3}) == {"foreach": True, "fused": None}  # torch's CPU default is a loop
    assert _built("sgd", {"lr": 0.1, "foreach": False}) == {"foreach": False, "fused": None}
    assert _built("adamw", {"lr": 1e-3, "fused": True}) == {"foreach": None, "fused": True}  # never both


def test_the_multi_tensor_step_gives_the_loops_update():
    torch.manual_seed(0)
    params = [torch.randn(n, dtype=torch.float64) for n in (3, 5, 7)]
    grads = [torch.randn_like(p) for p in params]
    results = []
    for foreach in (True, False):
        ps = [torch.nn.Parameter(p.clone()) for p in params]
        opt = build_optimizer("adamw", ps, {"lr": 1e-2, "foreach": foreach})
        for _ in range(3):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.step()
        results.append(ps)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)


def test_unknown_arguments_are_refused():
    with pytest.raises(InvalidInput, match="takes no argument 'momentum'"):
        build_optimizer("adamw", [torch.nn.Parameter(torch.zeros(1))], {"momentum": 0.9})


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_the_step_without_torchs_wrapper_is_the_same_step_and_keeps_hooks(name):
    torch.manual_seed(0)
    params = [torch.randn(n, dtype=torch.float64) for n in (3, 5)]
    grads = [torch.randn_like(p) for p in params]
    results, called = [], []
    for take in (optim.step, lambda opt: opt.step()):
        ps = [torch.nn.Parameter(p.clone()) for p in params]
        opt = build_optimizer(name, ps, {"lr": 1e-2, "weight_decay": 0.1})
        for _ in range(3):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            take(opt)
        results.append((ps, opt.state_dict()))
    (ours, our_state), (theirs, their_state) = results
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert str(our_state) == str(their_state)  # the same state, step counts included
    # a registered hook (none is on a worker) is honoured: the plain call runs it
    opt = build_optimizer(name, [torch.nn.Parameter(torch.zeros(2))], {"lr": 0.1})
    opt.register_step_pre_hook(lambda *_: called.append("pre"))
    handle = optim.torch_optimizer.register_optimizer_step_post_hook(lambda *_: called.append("global post"))
    try:
        optim.step(opt)
    finally:
        handle.remove()
    assert called == ["pre", "global post"]
