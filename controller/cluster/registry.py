"""The resource manager's view of the cluster: which workers exist, where, and whether alive."""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from atoll._rpc import atoll_pb2 as pb
from atoll._rpc import atoll_pb2_grpc as pb_grpc
from atoll.errors import InvalidInput
from atoll.net.rpc import Endpoint


@dataclass(slots=True)
class WorkerRecord:
    worker_id: str
    address: str
    device: str
    host: str
    pid: int
    gpu_uuid: str
    endpoint: Endpoint
    island: str = ""
    """Workers with a fast interconnect (by default, one host's)."""
    value_address: str = ""
    """host:port of the worker's remote-value server (data plane)."""
    last_heartbeat: float = field(default_factory=time.monotonic)
    alive: bool = True
    death: str = ""
    died_at: float = 0.0
    """time.monotonic() when it was marked dead."""
    jobs: set[str] = field(default_factory=set)
    rss_bytes: int = 0
    """Resident memory of the worker's process, from its last heartbeat."""

    def describe(self) -> str:
        return f"worker {self.worker_id} ({self.device} at {self.address}, island {self.island})"


class Registry:
    def __init__(
        self,
        *,
        token: str,
        heartbeat_interval_s: float,
        heartbeat_timeout_s: float,
        rpc_timeout_s: float,
        on_death: Callable[[WorkerRecord], None],
        controller_key: str = "",
    ):
        self._token, self._controller_key = token, controller_key
        self.heartbeat_interval_s, self.heartbeat_timeout_s = heartbeat_interval_s, heartbeat_timeout_s
        self._rpc_timeout_s = rpc_timeout_s
        self._on_death = on_death
        self._workers: dict[str, WorkerRecord] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def register(self, req: pb.RegisterWorkerRequest) -> WorkerRecord:
        if not req.address or not req.device:
            raise InvalidInput("a worker registers with its address and device")
        replaced = []
        with self._lock:
            # A worker registering again keeps its id, unless another worker (another address)
            # holds it now: after a controller restart, say, a new worker may have taken it first.
            asked = req.worker_id if re.fullmatch(r"w[0-9]{1,9}", req.worker_id) else ""
            holder = self._workers.get(asked) if asked else None
            keep = asked and (holder is None or holder.address == req.address)
            worker_id = asked if keep else self._new_id()
            # a worker restarted on the same address replaces its old record
            for old in self._workers.values():
                if old.address == req.address and old.alive:
                    replaced.append(old)
            record = WorkerRecord(
                worker_id=worker_id,
                address=req.address,
                device=req.device,
                host=req.host,
                pid=req.pid,
                gpu_uuid=req.gpu_uuid,
                island=req.island or req.host,
                value_address=req.value_address,
                endpoint=Endpoint(
                    req.address, self._token, pb_grpc.WorkerStub, self._rpc_timeout_s, self._controller_key
                ),
            )
            self._workers[record.worker_id] = record
        for old in replaced:
            self.mark_dead(old, f"replaced by {record.worker_id} registering at the same address")
        return record

    def _new_id(self) -> str:
        """A fresh id: the counter never repeats one, and it skips the ids workers kept (a dead
        worker's id is never given to another)."""
        while (worker_id := f"w{next(self._ids)}") in self._workers:
            pass
        return worker_id

    def heartbeat(self, worker_id: str, rss_bytes: int = 0) -> bool:
        with self._lock:
            record = self._workers.get(worker_id)
            if record is None or not record.alive:
                return False
            record.last_heartbeat = time.monotonic()
            record.rss_bytes = max(0, rss_bytes)
            return True

    def deregister(self, worker_id: str, reason: str) -> WorkerRecord | None:
        """A worker that is stopping leaves: it is marked dead (its jobs handled as a dead
        worker's) and dropped from the registry. None for an unknown worker."""
        with self._lock:
            record = self._workers.get(worker_id)
        if record is None:
            return None
        self.mark_dead(record, reason)
        with self._lock:
            self._workers.pop(worker_id, None)
        record.endpoint.close()
        return record

    def mark_dead(self, record: WorkerRecord, reason: str) -> None:
        with self._lock:
            if not record.alive:
                return
            record.alive, record.death, record.died_at = False, reason, time.monotonic()
        self._on_death(record)

    def get(self, worker_id: str) -> WorkerRecord | None:
        with self._lock:
            return self._workers.get(worker_id)

    def all(self) -> list[WorkerRecord]:
        with self._lock:
            return list(self._workers.values())

    def live(self) -> list[WorkerRecord]:
        return [w for w in self.all() if w.alive]

    def forgive(self, seconds: float) -> None:
        """Do not count the last ``seconds`` as silence of any worker."""
        now = time.monotonic()
        for record in self.live():
            record.last_heartbeat = min(now, record.last_heartbeat + seconds)

    def sweep(self) -> None:
        now = time.monotonic()
        for record in self.live():
            silent = now - record.last_heartbeat
            if silent > self.heartbeat_timeout_s:
                self.mark_dead(record, f"no heartbeat for {silent:.1f}s")

    def run_health_checks(self) -> None:
        def loop():
            period, last = self.heartbeat_interval_s / 2, time.monotonic()
            while not self._stop.wait(period):
                now = time.monotonic()
                stalled, last = now - last - period, now
                if stalled > self.heartbeat_interval_s:
                    # this process itself stood still (a long call holding the GIL, say, such as
                    # parsing a large program): heartbeats could not be taken in meanwhile either
                    self.forgive(stalled)
                self.sweep()

        threading.Thread(target=loop, name="health", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        for record in self.all():
            record.endpoint.close()
