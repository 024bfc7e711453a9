"""Bucketed gradient averaging (runtime/worker/executor/buckets.py) on a real gloo group of two replicas in
this process (one thread each): buckets start during the last backward, tied parameters wait
for the end, and every gradient comes out as the replicas' mean."""

import copy
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

from atoll.worker.executor.buckets import FIRST_BUCKET_BYTES, GradBuckets
from atoll.worker.transports.gloo import GlooTransport


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])  # just over 1 MiB a layer: the first bucket


def _replica(rank, model, store, results):
    tied = model[3].bias
    group = GlooTransport(store=store, rank=rank, world_size=2, hostname="127.0.0.1", timeout_s=30)
    buckets = GradBuckets({0: list(model.parameters())}, {id(tied)}, group, timeout_s=30)
    x = torch.full((2, 512), float(rank + 1))
    model(x).sum().backward()  # an earlier microbatch: nothing starts
    started_early = len(buckets._handles)
    with buckets.last_backward(0):
        model(x).sum().backward()
        started_during = len(buckets._handles)
    started_at_end = len(buckets._handles)
    reduced = buckets.finish()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    results[rank] = (started_early, started_during, started_at_end, reduced, grads)
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
    (early, during, at_end, reduced, grads0), (*_, grads1) = results[0], results[1]
    # DDP's sizes: the first bucket (1 MiB: the last layer's gradients) goes while the backward
    # runs, the rest (under 25 MiB) when it ends
    assert early == 0 and during == 1 and at_end == 2
    total = sum(g.nbytes for g in grads0.values())
    assert reduced == total and total > 3 * FIRST_BUCKET_BYTES
    # the mean of the two replicas' gradients (each accumulated over two microbatches)
    model = _model()
    for rank in (0, 1):
        for _ in range(2):
            model(torch.full((2, 512), float(rank + 1))).sum().backward()
    for name, p in model.named_parameters():
        expected = p.grad / 2
        assert torch.allclose(grads0[name], expected, rtol=1e-6), name
        assert torch.equal(grads0[name], grads1[name]), name
