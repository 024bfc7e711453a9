"""A worker's byte counts on their own (runtime/core/memory.py), without processes."""

import torch

from atoll.core.memory import GradientBytes, storage_bytes


def test_gradient_bytes_follow_the_gradients_a_step_holds():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 5, 7)]
    count = GradientBytes()
    assert count([p.grad for p in params]) == 0  # none yet
    sum(p.sum() for p in params).backward()
    assert count([p.grad for p in params]) == 4 * (3 + 5 + 7)
    params[1].grad = None  # a stage's gradient dropped: counted again, not remembered
    assert count([p.grad for p in params]) == 4 * (3 + 7)
    flat = torch.zeros(15)  # gradients as views of one buffer count its storage once
    for p, (start, n) in zip(params, [(0, 3), (3, 5), (8, 7)]):
        p.grad = flat[start : start + n]
    grads = [p.grad for p in params]
    assert count(grads) == storage_bytes(grads) == 4 * 15
    for _ in range(5):  # sets it has not seen lately: it forgets old ones and stays exact
        fresh = [torch.zeros(n) for n in (3, 5, 7)]
        assert count(fresh) == 4 * 15
