"""Parallel dispatch: one call to every worker of a job at once.

Downstream workers wait on their data-plane receives, not on the controller, so all ranks must
be called together; a rank called late would only leave its peers waiting.
"""

from __future__ import annotations

from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from atoll.controller.registry import WorkerRecord
from atoll.errors import AtollError


@dataclass(frozen=True, slots=True)
class Call:
    worker: WorkerRecord
    method: str
    request: object


class DispatchError(AtollError):
    def __init__(self, worker: WorkerRecord, error: AtollError):
        super().__init__(f"{worker.describe()}: {error}")
        self.worker = worker
        self.error = error
        self.code = error.code


class Dispatcher:
    def __init__(self, max_parallel: int = 64):
        self._pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="dispatch")

    def submit(self, calls: list[Call], timeout_s: float) -> list[Future]:
        """Send every call now, each from its own thread; returns at once."""
        return [self._pool.submit(c.worker.endpoint.call, c.method, c.request, timeout_s) for c in calls]

    def sequential(self, calls: list[Call], timeout_s: float) -> list[Future]:
        """Send each call (a step: ``RunStep``) only once the previous one's worker reports that
        the step has started there; returns at once after the last has started. For measuring
        what parallel dispatch saves; a rank cannot wait for the next one's start, since it
        would block on its sends to it."""
        futures: list[Future] = []
        for call in calls:
            stream = call.worker.endpoint.stream(f"{call.method}Stream", call.request, timeout_s)
            started: Future = Future()
            try:
                next(stream)
            except AtollError as e:
                started.set_exception(e)
                futures.append(started)
                continue  # the later calls still go: their gang positions are taken
            futures.append(self._pool.submit(lambda s=stream: next(s).reply))
        return futures

    @staticmethod
    def gather(calls: list[Call], futures: list[Future]) -> list:
        """Replies in call order; raises the first failure as soon as it happens."""
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for call, future in zip(calls, futures):
            if future in done and future.exception() is not None:
                raise DispatchError(call.worker, future.exception())
        return [f.result() for f in futures]

    def each(self, calls: list[Call], timeout_s: float) -> list[AtollError | object]:
        """Replies or errors in call order, waiting for all (for cleanup, where failures are expected)."""
        futures = [self._pool.submit(c.worker.endpoint.call, c.method, c.request, timeout_s) for c in calls]
        return [f.exception() or f.result() for f in futures]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
