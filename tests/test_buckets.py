"""Bucketed gradient averaging (runtime/worker/executor/buckets.py) on a real gloo group of two replicas in
this process (one thread each): buckets start during the last backward, tied parameters wait
for the end, and every gradient comes out as the replicas' mean."""

import copy
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

from atoll.worker.executor.buckets import BUCKET_BYTES, GradBuckets
from atoll.worker.transports.gloo import GlooTransport


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])  # 257 KiB per layer: a bucket each


def _replica(rank, model, store, results):
    tied = model[3].bias
    group = GlooTransport(store=store, rank=rank, world_size=2, hostname="127.0.0.1", timeout_s=30)
    buckets = GradBuckets({0: list(model.parameters())}, {id(tied)}, group, timeout_s=30)
    x = torch.full((2, 256), float(rank + 1))
    model(x).sum().backward()  # an earlier microbatch: nothing starts
    started_early = len(buckets._handles)
    with buckets.last_backward(0):
        model(x).sum().backward()
    started_during = len(buckets._handles)
    reduced = buckets.finish()
    results[rank] = (started_early, started_during, reduced, {k: p.grad.clone() for k, p in model.named_parameters()})
    group.close()


@pytest.mark.timeout(60)
def test_buckets_start_during_the_last_backward_and_average_every_gradient():
    store = dist.HashStore()
    results = {}
    base = _model()  # the replicas' threads share torch's generator: copies, not seeds
    threads = [threading.Thread(target=_replica, args=(r, copy.deepcopy(base), store, results)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert set(results) == {0, 1}
    (early, during, reduced, grads0), (_, _, _, grads1) = results[0], results[1]
    assert early == 0 and during >= 3  # one bucket per full layer, before the backward ended
    total = sum(g.nbytes for g in grads0.values())
    assert reduced == total and total > 3 * BUCKET_BYTES
    # the mean of the two replicas' gradients (each accumulated over two microbatches)
    model = _model()
    for rank in (0, 1):
        for _ in range(2):
            model(torch.full((2, 256), float(rank + 1))).sum().backward()
    for name, p in model.named_parameters():
        expected = p.grad / 2
        assert torch.allclose(grads0[name], expected, rtol=1e-6), name
        assert torch.equal(grads0[name], grads1[name]), name
