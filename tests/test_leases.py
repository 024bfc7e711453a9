"""Job leases (controller/cluster/leases.py): a job is closed once the client process that submitted it
has died and its lease has run out; a detached job and a live client's job stay."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

import atoll
from tests import models

pytestmark = pytest.mark.cluster  # every test here starts processes

ROOT = Path(__file__).resolve().parent.parent
CLIENT = """
import sys, time
import atoll
from tests import models
client = atoll.connect(sys.argv[1], sys.argv[2])
for detached in (False, True):
    model, batches, loss_fn = models.mlp()
    x, y = batches[0]
    job = client.pipeline(model, example_input=x, example_target=y, loss_fn=loss_fn, stages=1, microbatches=2,
                          detached=detached)
    job.step(x, y)
    print(job.id, flush=True)
time.sleep(600)
"""


def _jobs(client) -> dict[str, str]:
    return {j.job_id: j.state for j in client.status().jobs}


def test_a_dead_clients_job_is_closed_after_its_lease(tmp_path, record_property):
    lease = 2.0
    with atoll.LocalCluster(workers=2, lease_timeout_s=lease) as cluster, cluster.client() as client:
        model, batches, loss_fn = models.mlp()
        x, y = batches[0]
        mine = client.pipeline(model, example_input=x, example_target=y, loss_fn=loss_fn, stages=1, microbatches=2)
        child = subprocess.Popen(
            [sys.executable, "-c", CLIENT, cluster.address, cluster.token], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        try:
            owned, detached = child.stdout.readline().strip(), child.stdout.readline().strip()
            assert owned and detached, "the client process submitted no jobs"
            assert {owned, detached} <= _jobs(client).keys()
        finally:
            child.kill()
            child.wait(10)
        killed = time.monotonic()
        deadline = time.monotonic() + lease + 15
        while owned in _jobs(client) and time.monotonic() < deadline:
            time.sleep(0.2)
        jobs = _jobs(client)
        record_property("closed_after_s", time.monotonic() - killed)
        assert owned not in jobs, f"the dead client's job was not closed within {lease + 15}s of its lease"
        assert jobs.get(detached) == "ready"  # detached: kept until closed
        assert not any(owned in w.jobs for w in client.status().workers)  # its workers are free again
        assert mine.step(x, y) > 0  # this client renews its lease: its job lives on, past several leases
        client.job(detached).close()
        mine.close()
        assert all(not w.jobs for w in client.status().workers)
