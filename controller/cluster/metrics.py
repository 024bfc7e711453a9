"""What the controller measures of its jobs: the Prometheus metrics served with
``atoll controller --metrics-port`` (a job's last loss and peak memory, for status, are kept on
the job itself: Job.stepped).

Metrics live in a registry of this controller's own (never prometheus_client's global one), so
several controllers in one process (tests) do not mix. Per job (labels ``job``, the id, and
``name``):

- ``atoll_job_steps_total``: training steps completed;
- ``atoll_step_seconds``: a step's latency at the controller, dispatch to the last reply
  (histogram, also labelled ``mode``: train, evaluate, forward);
- ``atoll_bytes_moved_total``: data-plane bytes each worker measured (label ``worker``; ``kind``
  is sent, received, all_reduced or island_all_reduced, as in a step's ``data_plane_bytes``);
- ``atoll_job_failures_total``: 1 once the job has failed.

A closed job's series are removed (they would otherwise grow without bound). Read at each
scrape: ``atoll_workers_alive``, ``atoll_workers`` (by state), ``atoll_worker_rss_bytes``
(per worker, from its heartbeats), ``atoll_jobs`` (by state) and ``atoll_admission_queue``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from atoll.core.names import STEP_MODES
from atoll.errors import WorkerUnavailable
from atoll.net import address as _address

log = logging.getLogger("atoll.controller")

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, float("inf"))
BYTE_KINDS = ("sent", "received", "all_reduced", "island_all_reduced")


class _Live:
    """Gauges read from the controller's state at each scrape."""

    def __init__(self, workers: Callable[[], list], jobs: Callable[[], list], queued: Callable[[], int]):
        self._workers, self._jobs, self._queued = workers, jobs, queued

    def collect(self):
        workers = self._workers()
        alive = GaugeMetricFamily("atoll_workers_alive", "Workers registered and heartbeating")
        alive.add_metric([], sum(w.alive for w in workers))
        yield alive
        by_state = GaugeMetricFamily("atoll_workers", "Workers the controller knows, by state", labels=["state"])
        by_state.add_metric(["alive"], sum(w.alive for w in workers))
        by_state.add_metric(["dead"], sum(not w.alive for w in workers))
        yield by_state
        rss = GaugeMetricFamily(
            "atoll_worker_rss_bytes",
            "Resident memory of a live worker's process at its last heartbeat",
            labels=["worker", "island", "device"],
        )
        for w in workers:
            if w.alive:
                rss.add_metric([w.worker_id, w.island, w.device], w.rss_bytes)
        yield rss
        jobs = GaugeMetricFamily("atoll_jobs", "Jobs the controller holds, by state", labels=["state"])
        counts: dict[str, int] = {}
        for j in self._jobs():
            counts[j.state.value] = counts.get(j.state.value, 0) + 1
        for state, n in sorted(counts.items()):
            jobs.add_metric([state], n)
        yield jobs
        queue = GaugeMetricFamily("atoll_admission_queue", "Job requests waiting for workers")
        queue.add_metric([], self._queued())
        yield queue


class ControllerMetrics:
    def __init__(self, workers: Callable[[], list], jobs: Callable[[], list], queued: Callable[[], int]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.steps = Counter("atoll_job_steps", "Training steps completed", ["job", "name"], registry=r)
        self.step_seconds = Histogram(
            "atoll_step_seconds",
            "Latency of a step at the controller, from dispatch to the last worker's reply",
            ["job", "name", "mode"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.bytes_moved = Counter(
            "atoll_bytes_moved",
            "Data-plane bytes a worker moved for a job, as it measured them",
            ["job", "name", "worker", "kind"],
            registry=r,
        )
        self.failures = Counter("atoll_job_failures", "Job failures", ["job", "name"], registry=r)
        r.register(_Live(workers, jobs, queued))
        self._moved: dict[str, set[tuple[str, str]]] = {}  # per job id: its (worker, kind) series
        self._server = None
        self.address = ""

    def step(self, job, mode: str, seconds: float, replies: list) -> None:
        """A step of ``job`` ended well after ``seconds``; ``replies`` are the workers' RunStepReply
        in worker order. Counts the step. The bytes each worker moved are counted only while
        metrics are served: that parses every worker's accounting, about 10 µs each, which a job
        of a thousand workers would otherwise pay on every step."""
        if mode == "train":
            self.steps.labels(job.job_id, job.name).inc()
        self.step_seconds.labels(job.job_id, job.name, mode).observe(seconds)
        if self._server is None:
            return
        for worker, reply in zip(job.workers, replies):
            try:
                moved = json.loads(reply.memory_json or "{}").get("data_plane_bytes", {})
                for kind in BYTE_KINDS:
                    if moved.get(kind):
                        self.bytes_moved.labels(job.job_id, job.name, worker.worker_id, kind).inc(moved[kind])
                        self._moved.setdefault(job.job_id, set()).add((worker.worker_id, kind))
            except (ValueError, TypeError, AttributeError):  # a worker's accounting is for show: never fail a step
                continue

    def failed(self, job) -> None:
        self.failures.labels(job.job_id, job.name).inc()

    def forget(self, job) -> None:
        """Drop a closed job's series."""
        for metric in (self.steps, self.failures):
            _remove(metric, job.job_id, job.name)
        for mode in STEP_MODES:
            _remove(self.step_seconds, job.job_id, job.name, mode)
        for worker_id, kind in self._moved.pop(job.job_id, ()):
            _remove(self.bytes_moved, job.job_id, job.name, worker_id, kind)

    def serve(self, host: str, port: int) -> str:
        """Serve ``/metrics`` over HTTP on host:port (0: a free port); returns the bound host:port."""
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise WorkerUnavailable(f"could not serve metrics on {host}:{port}: {e.strerror or e}") from None
        self.address = _address.join(host, self._server.server_port)
        log.info("metrics on http://%s/metrics", self.address)
        return self.address

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _remove(metric, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:  # never observed
        pass
