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
    running_steps: int = 0
    """Step calls running on the worker at its last heartbeat (a step stuck in the data plane for a
    failed job included: it ends at that wait's deadline)."""
    returning: bool = False
    """Known from the state directory of a restarted controller, not registered again yet: not
    placed on, and dead once silent for the heartbeat timeout (controller/recovery.py)."""

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
        self.busy: Callable[[WorkerRecord], bool] = lambda record: False
        """A worker busy this way is not declared dead for its silence (Dispatcher.loading)."""
        self._workers: dict[str, WorkerRecord] = {}
        self._reserved: set[str] = set()
        """Ids of workers a state directory recorded: never given to another worker."""
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def expect(self, rows, reserved: set[str]) -> None:
        """A restarted controller's workers, as its state directory recorded them: each waits
        (``returning``) for its worker to register again; the ``reserved`` ids go to no other worker."""
        with self._lock:
            self._reserved |= reserved
            for row in rows:
                self._workers[row.worker_id] = WorkerRecord(
                    worker_id=row.worker_id,
                    address=row.address,
                    device=row.device,
                    host=row.host,
                    pid=0,
                    gpu_uuid="",
                    island=row.island,
                    endpoint=self._endpoint(row.address),
                    returning=True,
                )

    def _endpoint(self, address: str) -> Endpoint:
        return Endpoint(address, self._token, pb_grpc.WorkerStub, self._rpc_timeout_s, self._controller_key)

    def register(self, req: pb.RegisterWorkerRequest) -> WorkerRecord:
        if not req.address or not req.device:
            raise InvalidInput("a worker registers with its address and device")
        replaced = []
        with self._lock:
            # A worker registering again keeps its id, unless another worker (another address)
            # holds it now: after a controller restart, say, a new worker may have taken it first.
            asked = req.worker_id if re.fullmatch(r"w[0-9]{1,9}", req.worker_id) else ""
            holder = self._workers.get(asked) if asked else None
            if holder is not None and holder.returning and holder.alive and holder.address == req.address:
                # back after a controller restart: the same record, which its jobs hold
                holder.host, holder.pid, holder.gpu_uuid = req.host, req.pid, req.gpu_uuid
                holder.island, holder.value_address = req.island or req.host, req.value_address
                holder.returning, holder.last_heartbeat = False, time.monotonic()
                return holder
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
                endpoint=self._endpoint(req.address),
            )
            self._workers[record.worker_id] = record
        for old in replaced:
            self.mark_dead(old, f"replaced by {record.worker_id} registering at the same address")
        return record

    def _new_id(self) -> str:
        """A fresh id: the counter never repeats one, and it skips the ids workers kept (a dead
        worker's id is never given to another)."""
        while (worker_id := f"w{next(self._ids)}") in self._workers or worker_id in self._reserved:
            pass
        return worker_id

    def heartbeat(self, worker_id: str, rss_bytes: int = 0, running_steps: int = 0) -> bool:
        with self._lock:
            record = self._workers.get(worker_id)
            if record is None or not record.alive:
                return False
            record.last_heartbeat = time.monotonic()
            record.rss_bytes = max(0, rss_bytes)
            record.running_steps = max(0, running_steps)
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
        """The workers jobs may be placed on: alive, and registered with this controller."""
        return [w for w in self.all() if w.alive and not w.returning]

    def forgive(self, seconds: float) -> None:
        """Do not count the last ``seconds`` as silence of any worker."""
        now = time.monotonic()
        for record in self._alive():
            record.last_heartbeat = min(now, record.last_heartbeat + seconds)

    def _alive(self) -> list[WorkerRecord]:
        return [w for w in self.all() if w.alive]

    def sweep(self) -> None:
        now = time.monotonic()
        for record in self._alive():
            silent = now - record.last_heartbeat
            if silent > self.heartbeat_timeout_s and not self.busy(record):
                why = "did not register again after the controller restarted" if record.returning else "no heartbeat"
                self.mark_dead(record, f"{why} for {silent:.1f}s")

    def run_health_checks(self) -> None:
        """Sweep in the background from now on: the workers a restart expects have the heartbeat
        timeout from now, when the controller serves, to register again."""
        now = time.monotonic()
        for record in self._alive():
            record.last_heartbeat = max(record.last_heartbeat, now)

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
