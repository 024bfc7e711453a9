"""A dead worker fails the jobs that used it with a clear error; the rest of the cluster keeps going."""

import time

import pytest

import atoll
from tests import models

pytestmark = pytest.mark.cluster  # every test here starts processes


@pytest.mark.parametrize(
    "dispatch, victim_rank",
    [("parallel", 1), ("relay", 1), ("relay", 0)],
    ids=["direct", "relay-member-dies", "relaying-worker-dies"],
)
def test_killed_worker_fails_its_job_and_the_cluster_keeps_serving(dispatch, victim_rank, record_property):
    """Relayed dispatch sends the step through rank 0 (one group of 2), so the dead worker is
    either a relayed member or the relaying worker itself: the error names it either way."""
    with atoll.LocalCluster(workers=3, heartbeat_timeout_s=3.0) as cluster, cluster.client() as client:
        job, _, batches, _ = models.submit(
            client, stages=2, microbatches=2, data_plane_timeout_s=5.0, name="doomed", dispatch=dispatch
        )
        x, y = batches[0]
        job.step(x, y)
        workers = {w.worker_id: w for w in client.status().workers}
        victim = workers[next(j for j in client.status().jobs if j.job_id == job.id).workers[victim_rank]]
        index = [p.pid for p in cluster.workers].index(victim.pid)
        cluster.kill_worker(index)

        with pytest.raises(atoll.JobFailed) as err:  # an error naming the dead worker, not a hang
            job.step(x, y)
        assert victim.worker_id in str(err.value)
        with pytest.raises(atoll.JobFailed, match="has failed and must be submitted again"):
            job.step(x, y)

        started = time.monotonic()
        deadline = started + 15
        while True:
            status = client.status()
            dead = {w.worker_id for w in status.workers if not w.alive}
            if victim.worker_id in dead or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        record_property("marked_dead_after_s", time.monotonic() - started)
        assert dead == {victim.worker_id}
        assert next(j for j in status.jobs if j.job_id == job.id).state == "failed"
        assert all(job.id not in w.jobs for w in status.workers)  # unloaded from the survivor at once
        job.close()

        # the two live workers take a new job and train it
        survivor, *_ = models.submit(client, stages=2, microbatches=2)
        losses = [survivor.step(x, y) for _ in range(3)]
        assert losses[-1] < losses[0]
        assert victim.worker_id not in next(j for j in client.status().jobs if j.job_id == survivor.id).workers
        with pytest.raises(atoll.NotEnoughWorkers, match="needs 3 workers .* but 2 are alive"):
            models.submit(client, stages=3, microbatches=2)
        survivor.close()
