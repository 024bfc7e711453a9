"""Three client processes train their own jobs on the same four workers at once: every job
trains as it would alone, and they progress at the same rate.

Progress is counted in a shared worker's own sequence of steps (tests.tenant): the order the
controller's fair queue dispatched them, which the host's scheduling of the client processes
does not change while every job keeps steps waiting."""

import subprocess
import sys
import threading

import pytest
import torch

import atoll
from atoll.client.local import stop_processes
from tests import models
from tests.reference import assert_matches_reference, train_reference
from tests.tenant import SGD, shares_when_the_first_finished, step_starts, train_queued

pytestmark = pytest.mark.cluster  # every test here starts processes

STEPS = 50
STEPS_WEIGHTED = 60


def test_three_clients_share_four_workers_fairly(tmp_path, record_property):
    go = tmp_path / "go"
    with atoll.LocalCluster(workers=4) as cluster:
        token_file = tmp_path / "token"
        token_file.write_text(cluster.token)
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.tenant",
                    cluster.address,
                    str(token_file),
                    str(seed),
                    str(STEPS),
                    str(go),
                    str(tmp_path / f"tenant{seed}.pt"),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            for seed in range(3)
        ]
        try:
            for p in procs:  # all three jobs are loaded before any trains
                line = p.stdout.readline()
                assert line.strip() == "ready", line + p.stdout.read()
            go.touch()
            for p in procs:
                output, _ = p.communicate(timeout=240)
                assert p.returncode == 0, output
        finally:
            stop_processes(procs)
    results = {seed: torch.load(tmp_path / f"tenant{seed}.pt") for seed in range(3)}
    for seed, got in results.items():
        model, batches, loss_fn = models.mlp(seed)
        steps = [batches[i % len(batches)] for i in range(STEPS)]
        ref_losses, ref_state = train_reference(model, steps, loss_fn, 2, "sgd", SGD)
        assert_matches_reference(got["losses"], got["state"], ref_losses, ref_state)
    # each job's share of the steps run while all three ran, counted when the first finished
    done = list(shares_when_the_first_finished({seed: r["started"] for seed, r in results.items()}).values())
    record_property("steps_done_when_the_first_finished", done)
    assert min(done) >= 0.8 * max(done), f"steps done when the first job finished: {done}"


def test_busy_jobs_share_workers_in_proportion_to_their_weights(record_property):
    """Two jobs on the same two workers, weights 2 and 1, both always with steps waiting: while
    both run, the first gets about twice the steps (weighted fair dispatch, controller/cluster/fairness.py)."""
    with atoll.LocalCluster(workers=2) as cluster, cluster.client() as client:
        _weighted_run(client, record_property)


def _weighted_run(client, record_property) -> None:
    jobs, losses = {}, {}
    for name, weight in (("heavy", 2.0), ("light", 1.0)):
        model, batches, loss_fn = models.mlp(0)
        x, y = batches[0]
        jobs[name] = client.pipeline(
            model, example_input=x, example_target=y, loss_fn=loss_fn, stages=2, microbatches=2, name=name,
            weight=weight,
        )  # fmt: skip
    workers = {n: set(j.plan.report["placement"][r].split()[0] for r in ("0", "1")) for n, j in jobs.items()}
    assert workers["heavy"] == workers["light"]  # they share both workers

    def run(name: str, steps: int) -> None:
        losses[name] = train_queued(jobs[name], [(x, y)] * steps)

    threads = [threading.Thread(target=run, args=(n, STEPS_WEIGHTED)) for n in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    try:
        assert all(not t.is_alive() for t in threads) and all(len(v) == STEPS_WEIGHTED for v in losses.values())
        done = shares_when_the_first_finished({n: step_starts(j, STEPS_WEIGHTED) for n, j in jobs.items()})
        heavy, light = done["heavy"], done["light"]
        record_property("heavy_light_steps_when_the_first_finished", [heavy, light])
        assert 1.6 <= heavy / light <= 2.4, f"steps done when the first job finished: heavy {heavy}, light {light}"
    finally:
        for job in jobs.values():
            job.close()
