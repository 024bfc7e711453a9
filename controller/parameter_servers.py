"""Parameter-server jobs on the controller: placement, key layout, loading, and what a worker's
death does to one (runtime/worker/ps/ runs them; docs/parameter_servers.md).

The controller decides and then steps aside: it places ``servers + tasks`` workers, splits the
model into keys and places them by consistent hashing (atoll.core.ps_layout), loads each server
with the initial values of the shards its chains give it and each task with the graph, and answers
with the tasks' addresses, which the client feeds straight. A dead server is left out of every
chain (its shards' next replicas already hold every acknowledged update) and each shard it held is
copied from its chain's tail to another server, which joins the chain after it; a dead task is
dropped, and the servers stop waiting for it.

With a state directory (controller/statedir.py) each job's row is kept as it stands: a restarted
controller takes the jobs back (``recover``) while their servers and tasks go on serving their
clients, so it can list, close, lease and repair them as before.
"""

from __future__ import annotations

import itertools
import logging
import re
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from atoll._rpc import atoll_pb2 as pb
from atoll._rpc import atoll_pb2_grpc as pb_grpc
from atoll.controller.cluster.registry import Registry, WorkerRecord
from atoll.controller.statedir import MemoryState, PsJobRow
from atoll.core import ps_layout
from atoll.core.ps_rules import Consistency, UpdateRule
from atoll.core.wire import spec_of_pb_tensor, tensor_spec_to_pb
from atoll.errors import AtollError, InvalidInput
from atoll.net.rpc import Endpoint

log = logging.getLogger("atoll.controller")

ID_PREFIX = "ps"
ID_PATTERN = re.compile(r"ps[0-9]+-[0-9a-f]{6}")
"""A job's id: a number and this controller's random tag, so that a restarted controller (which
may not know the jobs of its predecessor: without a state directory their workers still serve
their clients, unknown to it) gives no id twice to the workers' roles."""


@dataclass(eq=False)
class PsJob:
    job_id: str
    config: pb.PsConfig
    servers: list[WorkerRecord]
    tasks: list[WorkerRecord]
    chains: list[list[int]]
    session: str = ""
    """The client session whose lease keeps the job ("" for none)."""
    dropped: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def workers(self) -> list[WorkerRecord]:
        return [*self.servers, *self.tasks]

    def row(self) -> PsJobRow:
        return PsJobRow(
            job_id=self.job_id,
            session=self.session,
            config=self.config.SerializeToString(),
            servers=tuple(w.worker_id for w in self.servers),
            tasks=tuple(w.worker_id for w in self.tasks),
            chains=tuple(tuple(c) for c in self.chains),
            dropped=tuple(sorted(self.dropped)),
        )


class ParameterServers:
    def __init__(
        self,
        *,
        place,
        jobs_lock: threading.Lock,
        leases,
        token: str,
        controller_key: str,
        timeout_s: float,
        records: MemoryState | None = None,
    ):
        self._place = place
        self._records = records or MemoryState()
        self._leases = leases
        """(ranks, device, islands, exclusive) -> workers: Lifecycle.place, under ``jobs_lock``."""
        self._jobs_lock = jobs_lock
        self._token, self._key, self._timeout_s = token, controller_key, timeout_s
        self._jobs: dict[str, PsJob] = {}
        self._ids = itertools.count(1)
        self._tag = secrets.token_hex(3)
        self._pool = ThreadPoolExecutor(16, thread_name_prefix="ps-load")
        self._endpoints: dict[str, Endpoint] = {}
        """One channel per worker address, for every job's calls to it."""
        self._lock = threading.Lock()

    def holds_session(self, session: str) -> bool:
        return any(job.session == session for job in list(self._jobs.values()))

    def owns(self, job_id: str) -> bool:
        return ID_PATTERN.fullmatch(job_id) is not None

    def _endpoint(self, w: WorkerRecord) -> Endpoint:
        with self._lock:
            if w.address not in self._endpoints:
                self._endpoints[w.address] = Endpoint(
                    w.address, self._token, pb_grpc.ParameterServerStub, self._timeout_s, self._key
                )
            return self._endpoints[w.address]

    def submit(self, request: pb.PsProgram) -> pb.PsJobReply:
        config = request.config
        servers, tasks, replication = request.servers, config.tasks, request.replication or 1
        if tasks < 1:
            raise InvalidInput(f"a parameter-server job needs at least one task, got {tasks}")
        # refused before any worker is placed
        UpdateRule(config.optimizer, config.lr, config.weight_decay)
        Consistency(config.consistency, config.max_delay, config.wait_timeout_s)
        values = {v.name: v.tensor for v in request.values}
        specs = {name: spec_of_pb_tensor(t) for name, t in values.items()}
        shapes = {name: spec.shape for name, spec in specs.items()}
        keys = ps_layout.split_keys(shapes, set(request.sparse_params), servers, request.rows_per_key or 65536)
        chains = ps_layout.chains(servers, replication)
        with self._jobs_lock:
            workers = self._place(servers + tasks, "cpu", (), False)
            job_id = f"{ID_PREFIX}{next(self._ids)}-{self._tag}"
            for w in workers:
                w.jobs.add(job_id)
        job = PsJob(job_id, pb.PsConfig(), workers[:servers], workers[servers:], chains, request.session)
        if job.session:
            self._leases.renew(job.session)
        config = pb.PsConfig()
        config.CopyFrom(request.config)
        config.job_id = job_id
        layout = config.layout
        layout.keys.extend(
            pb.PsKey(key=k.key, param=k.param, row_start=k.row_start, row_end=k.row_end, shard=k.shard, sparse=k.sparse)
            for k in keys
        )
        layout.servers.extend(w.address for w in job.servers)
        layout.chains.extend(pb.PsChain(servers=c) for c in chains)
        layout.param_names.extend(values)
        layout.params.extend(tensor_spec_to_pb(spec) for spec in specs.values())
        job.config = config
        self._jobs[job_id] = job
        try:
            self._load(job, keys, values, request.graph)
        except AtollError:
            self.close(job_id)
            raise
        self._records.ps_job(job.row())
        log.info("parameter-server job %s: %d servers, %d tasks, %d keys", job_id, servers, tasks, len(keys))
        return pb.PsJobReply(
            job_id=job_id,
            task_addresses=[w.address for w in job.tasks],
            layout=layout,
            server_worker_ids=[w.worker_id for w in job.servers],
            task_worker_ids=[w.worker_id for w in job.tasks],
        )

    def _load(self, job: PsJob, keys, values: dict, graph: bytes) -> None:
        calls = []
        for i, w in enumerate(job.servers):
            held = {k.key: k for k in keys if i in job.chains[k.shard]}
            request = pb.PsLoadRequest(config=job.config, role="server", index=i)
            for k in held.values():
                request.values.add(name=k.key, tensor=_rows(values[k.param], k))
            calls.append((w, request))
        for i, w in enumerate(job.tasks):
            calls.append((w, pb.PsLoadRequest(config=job.config, role="task", index=i, graph=graph)))
        futures = [self._pool.submit(self._endpoint(w).call, "Load", r) for w, r in calls]
        for f in futures:
            f.result()

    def infos(self) -> list[pb.JobInfo]:
        """The jobs as ``atoll status`` lists them (their steps run client to task: not counted here)."""
        return [
            pb.JobInfo(
                job_id=job.job_id,
                name=job.job_id,
                state="ready",
                workers=[w.worker_id for w in job.workers],
                schedule=f"parameter-server {job.config.consistency}",
                stages=len(job.tasks),
            )
            for job in list(self._jobs.values())
        ]

    def recover(self, rows: tuple[PsJobRow, ...], registry: Registry) -> None:
        """A restart on a state directory: take back the recorded jobs (at start, before serving).
        Their workers are the registry's recorded ones, coming back; one that does not is declared
        dead in time, and the job is repaired as if it had died now."""
        for row in rows:
            servers, tasks = [_recorded(registry, w) for w in row.servers], [_recorded(registry, w) for w in row.tasks]
            job = PsJob(
                row.job_id,
                pb.PsConfig.FromString(row.config),
                servers,
                tasks,
                [list(c) for c in row.chains],
                row.session,
                set(row.dropped),
            )
            with self._jobs_lock:
                for w in job.workers:
                    w.jobs.add(job.job_id)
            self._jobs[job.job_id] = job
            if job.session:  # its client has a lease's time to reconnect
                self._leases.renew(job.session)
            log.warning("parameter-server job %s taken back: servers %s, tasks %s", row.job_id, row.servers, row.tasks)

    def returned(self, record: WorkerRecord, held: list[pb.HeldJob]) -> list[str]:
        """``record``'s worker registered again (the controller restarted): the ids of the jobs
        it keeps a role in, those taken back with it (``recover``). Any other role it holds is
        no job this controller knows, and the worker drops it."""
        held_ids = {h.job_id for h in held}
        return [job.job_id for job in list(self._jobs.values()) if record in job.workers and job.job_id in held_ids]

    def close(self, job_id: str) -> None:
        job = self._jobs.pop(job_id, None)
        if job is None:
            return  # closing twice is fine
        self._records.ps_job_closed(job_id)
        for w in job.workers:
            if w.alive:
                try:
                    self._endpoint(w).call("Unload", pb.JobRef(job_id=job_id), timeout_s=10.0)
                except AtollError as e:
                    log.warning("parameter-server job %s: unloading from %s: %s", job_id, w.worker_id, e)
            with self._jobs_lock:
                w.jobs.discard(job_id)

    def run_lease_checks(self, stopped: threading.Event) -> None:
        """Close, in the background until ``stopped``, every job whose client's lease ran out."""

        def loop():
            while not stopped.wait(min(1.0, self._leases.timeout_s / 4)):
                for job in list(self._jobs.values()):
                    if job.session and self._leases.expired(job.session):
                        log.warning("parameter-server job %s: its client's lease ran out; closing it", job.job_id)
                        self.close(job.job_id)

        threading.Thread(target=loop, name="ps-leases", daemon=True).start()

    def worker_died(self, record: WorkerRecord) -> None:
        for job in list(self._jobs.values()):
            if record in job.workers:
                self._pool.submit(self._lost, job, record)

    def _lost(self, job: PsJob, record: WorkerRecord) -> None:
        try:
            self._repair(job, record)
        except Exception:  # noqa: BLE001 (a background repair: logged, the job goes on as it can)
            log.exception("parameter-server job %s: repairing after %s died failed", job.job_id, record.worker_id)

    def _repair(self, job: PsJob, record: WorkerRecord) -> None:
        with job.lock:
            if record in job.tasks:
                task = job.tasks.index(record)
                job.dropped.add(task)
                log.warning("parameter-server job %s: task %d died; the others go on without it", job.job_id, task)
                self._reconfigure(job)
                self._records.ps_job(job.row())
                return
            dead = job.servers.index(record)
            lost = [s for s, chain in enumerate(job.chains) if dead in chain]
            for chain in job.chains:
                if dead in chain:
                    chain.remove(dead)
            log.warning(
                "parameter-server job %s: server %d died; shards %s go on on their replicas", job.job_id, dead, lost
            )
            self._reconfigure(job)
            for shard in lost:  # copy each shard to a server that lacks it, to restore the replication
                chain = job.chains[shard]
                spare = [i for i, w in enumerate(job.servers) if w.alive and i not in chain]
                if not chain or not spare:
                    log.warning(
                        "parameter-server job %s: shard %d stays with %d replica(s)", job.job_id, shard, len(chain)
                    )
                    continue
                adopt = pb.PsAdoptRequest(job_id=job.job_id, shard=shard, source=chain[-1])  # the tail
                try:
                    self._endpoint(job.servers[spare[0]]).call("Adopt", adopt)
                    chain.append(spare[0])
                except AtollError as e:
                    log.warning("parameter-server job %s: copying shard %d failed: %s", job.job_id, shard, e)
            self._reconfigure(job)
            if job.job_id in self._jobs:  # not closed meanwhile
                self._records.ps_job(job.row())
            log.warning("parameter-server job %s: shard chains now %s", job.job_id, job.chains)

    def _reconfigure(self, job: PsJob) -> None:
        request = pb.PsReconfigureRequest(
            job_id=job.job_id, chains=[pb.PsChain(servers=c) for c in job.chains], dropped_tasks=sorted(job.dropped)
        )
        for w in job.workers:
            if w.alive:
                try:
                    self._endpoint(w).call("Reconfigure", request, timeout_s=10.0)
                except AtollError as e:
                    log.warning("parameter-server job %s: reconfiguring %s: %s", job.job_id, w.worker_id, e)


def _recorded(registry: Registry, worker_id: str) -> WorkerRecord:
    """The registry's record of a recorded job's worker; one that was dead before the restart has
    none (the state directory brings back only live workers): a dead record keeps its place."""
    record = registry.get(worker_id)
    if record is not None:
        return record
    return WorkerRecord(
        worker_id=worker_id, address="", device="cpu", host="", pid=0, gpu_uuid="", endpoint=None, alive=False
    )


def _rows(value: pb.TensorData, key: ps_layout.Key) -> pb.TensorData:
    """The rows of one key out of a parameter's bytes (a whole parameter as it is)."""
    spec = spec_of_pb_tensor(value)
    rows = spec.shape[0] if spec.shape else 1
    if key.row_start == 0 and key.row_end == rows:
        return value
    per_row = len(value.data) // rows
    return pb.TensorData(
        dtype=value.dtype,
        shape=[key.row_end - key.row_start, *spec.shape[1:]],
        data=value.data[key.row_start * per_row : key.row_end * per_row],
    )
