"""Cost-balanced partitioning (pure) and the costs the compiler measures on fake tensors."""

import itertools
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from atoll.client.export import split_names
from atoll.controller.compiler.partition import balanced_partition
from atoll.errors import InvalidInput
from tests.models import compile_locally


def brute_force_best(costs, parts):
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_balanced_partition_is_optimal():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        costs = [rng.choice([0, 1, 2, 5, 30]) + rng.random() for _ in range(n)]
        ranges = balanced_partition(costs, parts)
        assert len(ranges) == parts and ranges[0].start == 0 and ranges[-1].stop == n
        assert all(len(r) > 0 for r in ranges) and all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))
        assert max(sum(costs[i] for i in r) for r in ranges) == pytest.approx(brute_force_best(costs, parts))


def test_heavy_block_gets_a_stage_of_its_own():
    assert balanced_partition([10, 1, 1, 1, 1, 10], 3) == [range(0, 1), range(1, 5), range(5, 6)]


def test_partition_errors():
    with pytest.raises(InvalidInput, match="cannot split 2 pieces into 3 stages"):
        balanced_partition([1, 1], 3)
    # explicit split points are module names now: their errors are in tests/test_bad_input.py


def _compile(model, x, y, stages, split_points=None, **kw):
    split_at = tuple(split_names(model, split_points))
    return compile_locally(model, x, y, F.mse_loss, stages=stages, microbatches=2, split_at=split_at, **kw)


def test_compiler_balances_measured_flops():
    torch.manual_seed(0)
    # one wide block costs as much as all the narrow ones together
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)], nn.Sequential(nn.Linear(32, 256), nn.Linear(256, 32)))
    compiled = _compile(model, torch.randn(8, 32), torch.randn(8, 32), stages=2)
    # top-level children alone can only split 4 narrow | 1 wide; counting the optimizer's
    # per-parameter work the wide block costs more than half, so the split goes inside it
    assert [list(s.modules) for s in compiled.stages] == [["0", "1", "2", "3", "4.0"], ["4.1"]]
    linear = lambda n, k: 2 * 4 * n * k  # noqa: E731 (2*m*n*k FLOPs per linear, microbatch 4)
    assert compiled.stages[0].forward_flops == 4 * linear(32, 32) + linear(32, 256)
    assert compiled.stages[1].forward_flops == linear(256, 32)
    # with the narrow blocks twice as wide, whole children balance best and the split stays between them
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)], nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64)))
    compiled = _compile(model, torch.randn(8, 64), torch.randn(8, 64), stages=2)
    assert [list(s.modules) for s in compiled.stages] == [["0", "1", "2", "3"], ["4"]]
    assert compiled.stages[0].forward_flops == 4 * linear(64, 64)
    assert compiled.stages[1].forward_flops == 2 * linear(64, 256)


def test_explicit_split_points_are_obeyed():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)])
    compiled = _compile(model, torch.randn(4, 8), torch.randn(4, 8), stages=3, split_points=[1, 4])
    assert [list(s.modules) for s in compiled.stages] == [["0"], ["1", "2", "3"], ["4"]]
