"""Asynchronous dispatch (steps sent before the previous one finishes) and two jobs sharing workers."""

import threading

import pytest
import torch

import atoll
from tests import models
from tests.reference import assert_matches_reference, train_reference

pytestmark = pytest.mark.cluster  # every test here starts processes

ADAMW = {"lr": 1e-3}


def test_async_steps_match_the_reference(client4):
    job, model, batches, loss_fn = models.submit(
        client4, stages=4, microbatches=4, schedule="1f1b", optimizer="adamw", optimizer_args=ADAMW
    )
    try:
        futures = [job.step_async(x, y) for x, y in batches]  # all sent before any finishes
        state = job.state_dict()  # waits for every step sent so far
        assert all(f.done() for f in futures)
        losses = [f.result() for f in futures]
        assert [f.details().step for f in futures] == [1, 2, 3, 4, 5]
        assert job.last.step == 5
    finally:
        job.close()
    ref_losses, ref_state = train_reference(model, batches, loss_fn, 4, "adamw", ADAMW)
    assert_matches_reference(losses, state, ref_losses, ref_state)


def test_two_jobs_on_the_same_workers_step_concurrently(client4):
    jobs = [
        models.submit(client4, seed=seed, stages=4, microbatches=4, optimizer="adamw", optimizer_args=ADAMW)
        for seed in (0, 1)
    ]
    placements = [set(next(j for j in client4.status().jobs if j.job_id == job.id).workers) for job, *_ in jobs]
    assert placements[0] == placements[1]  # 4 workers, 4 ranks each: they share every worker
    results, errors = {}, []

    def train(job, batches):
        try:
            futures = [job.step_async(x, y) for x, y in batches]
            results[job.id] = ([f.result() for f in futures], job.state_dict())
        except Exception as e:  # surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=train, args=(job, batches)) for job, _, batches, _ in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    for job, *_ in jobs:
        job.close()
    assert not errors and not any(t.is_alive() for t in threads)
    for job, model, batches, loss_fn in jobs:
        losses, state = results[job.id]
        ref_losses, ref_state = train_reference(model, batches, loss_fn, 4, "adamw", ADAMW)
        assert_matches_reference(losses, state, ref_losses, ref_state)
        assert not torch.equal(state["0.weight"], jobs[0][1].state_dict()["0.weight"])  # it trained


def test_a_second_client_attaches_to_a_running_job(cluster4, client4):
    job, _, batches, _ = models.submit(client4, stages=2, microbatches=2)
    x, y = batches[0]
    try:
        first = [job.step(x, y) for _ in range(3)]
        with cluster4.client() as other:
            attached = other.job(job.id)
            assert attached.plan.report == job.plan.report
            later = attached.step(x, y)
            assert attached.last.step == 4
        assert later < first[0]
        # the first client's numbering is now stale: its next step is refused, not reordered
        with pytest.raises(atoll.InvalidInput, match=r"step number 4 is already used \(4 steps have gone out\)"):
            job.step(x, y)
        assert client4.job(job.id).step(x, y) < first[0]  # attaching again picks up the numbering
    finally:
        job.close()


def test_every_dispatch_mode_trains_the_same(client4):
    """dispatch="sequential" (each rank once the previous has started) and "relay" (through
    relaying workers: groups of 2 on 4 workers) give the same losses and weights as the default
    parallel dispatch (direct on 4 workers)."""
    results = []
    for mode in ("parallel", "sequential", "relay"):
        job, _, batches, _ = models.submit(client4, stages=4, microbatches=4, schedule="1f1b", dispatch=mode)
        try:
            results.append(([job.step(x, y) for x, y in batches], job.state_dict()))
        finally:
            job.close()
    (losses_p, state_p), *others = results
    for losses, state in others:
        assert losses == losses_p
        assert all(state_p[k].equal(state[k]) for k in state_p)
    with pytest.raises(atoll.InvalidInput, match="dispatch must be one of parallel, direct, relay, sequential"):
        models.submit(client4, stages=2, microbatches=2, dispatch="zigzag")
