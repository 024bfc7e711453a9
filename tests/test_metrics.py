"""`atoll controller --metrics-port`: Prometheus metrics per job and worker, from a real cluster."""

import re
import time
import urllib.request

import pytest

import atoll
from tests import models

pytestmark = pytest.mark.cluster  # every test here starts processes


@pytest.fixture(scope="module")
def cluster():
    with atoll.LocalCluster(workers=2, metrics_port=0) as cluster:
        yield cluster


def scrape(cluster) -> str:
    with urllib.request.urlopen(f"http://{cluster.metrics_address}/metrics", timeout=10) as reply:
        assert reply.status == 200
        return reply.read().decode()


def sample(text: str, metric: str, /, **labels: str) -> float | None:
    """The value of the series ``metric`` whose labels include ``labels`` (None if there is none)."""
    for line in text.splitlines():
        m = re.match(rf"{metric}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "").split(",") for k, v in labels.items()):
            return float(m.group(2))
    return None


@pytest.mark.timeout(240)
def test_steps_latency_and_bytes_of_a_job(cluster):
    assert re.fullmatch(r"127\.0\.0\.1:\d+", cluster.metrics_address)
    with cluster.client() as client:
        job, _, batches, _ = models.submit(client, stages=2, microbatches=2, name="metered")
        received = {}  # per worker: data-plane bytes received, as the step results report them
        for x, y in batches:  # exactly 5 training steps
            result = job.step_async(x, y).details()
            for worker, memory in result.memory.items():
                received[worker] = received.get(worker, 0) + memory["data_plane_bytes"]["received"]
        assert len(batches) == 5
        text = scrape(cluster)
        assert re.search(rf'atoll_job_steps_total\{{[^}}]*job="{job.id}"[^}}]*\}} 5\.0', text), text
        assert sample(text, "atoll_job_steps_total", job=job.id, name="metered") == 5.0
        assert sample(text, "atoll_step_seconds_count", job=job.id, mode="train") == 5.0
        assert sample(text, "atoll_step_seconds_sum", job=job.id, mode="train") > 0
        status = client.status()
        workers = next(j for j in status.jobs if j.job_id == job.id).workers
        for index, worker_id in enumerate(workers):
            moved = sample(text, "atoll_bytes_moved_total", job=job.id, worker=worker_id, kind="received")
            assert moved == received[index] > 0, (worker_id, moved, received)
        assert sample(text, "atoll_workers_alive") == 2.0
        assert sample(text, "atoll_jobs", state="ready") == 1.0
        assert sample(text, "atoll_job_failures_total", job=job.id) is None
        job.evaluate(*batches[0])  # not a training step: timed, not counted as one
        text = scrape(cluster)
        assert sample(text, "atoll_step_seconds_count", job=job.id, mode="evaluate") == 1.0
        assert sample(text, "atoll_job_steps_total", job=job.id) == 5.0
        job.close()
        text = scrape(cluster)  # a closed job's series are gone
        assert sample(text, "atoll_job_steps_total", job=job.id) is None
        assert sample(text, "atoll_bytes_moved_total", job=job.id) is None


@pytest.mark.timeout(240)
def test_failures_and_workers_alive(cluster, record_property):
    """A job whose worker dies fails: counted once; the dead worker leaves the alive gauge."""
    with cluster.client() as client:
        job, _, batches, _ = models.submit(client, stages=2, microbatches=2, name="doomed", data_plane_timeout_s=5.0)
        job.step(*batches[0])
        cluster.kill_worker(1)
        with pytest.raises(atoll.JobFailed):
            job.step(*batches[1])
        text = scrape(cluster)
        assert sample(text, "atoll_job_failures_total", job=job.id, name="doomed") == 1.0
        assert sample(text, "atoll_job_steps_total", job=job.id) == 1.0
        started = time.monotonic()
        deadline = started + 20  # marked dead by the failed step, or by its silence
        while sample(scrape(cluster), "atoll_workers_alive") != 1.0:
            assert time.monotonic() < deadline, scrape(cluster)
            time.sleep(0.2)
        record_property("alive_gauge_after_s", time.monotonic() - started)
        assert sample(scrape(cluster), "atoll_jobs", state="failed") == 1.0
        job.close()
