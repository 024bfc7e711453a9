"""The controller's state directory (``atoll controller --state-dir DIR``): what a restarted
controller needs to take its jobs back (controller/recovery.py).

SQLite, one file (``DIR/controller.db``), one transaction per change that matters, never one per
step except an auto_resume job's journal entry (the journal is what a restore replays):

- ``meta``: the schema version, the next job number.
- ``workers``: every worker ever registered: its id, address and whether it is alive (a returning
  worker gets its id back; no other worker ever gets an id recorded here).
- ``jobs``: one row per job not yet closed: its submitted program (a file beside the database,
  ``programs/JOB.pb``: it holds the model's weights and can be large), its name, session and islands,
  its placement (worker ids by worker index), its data-plane namespace and secret, its state, the
  training steps it had when loaded, its plan report and, when it failed, why.
- ``journal``: an auto_resume job's training steps since its last checkpoint: number, request, loss.
- ``closed``: the ids of closed jobs (a client asking about one is told it was closed).
- ``ps_jobs``: one row per parameter-server job not yet closed: its config (with the key layout),
  its servers' and tasks' worker ids, its shard chains, its dropped tasks and its session. Its
  servers and tasks keep serving the clients while the controller is down (the data path never
  passes through it); the row lets a restarted controller close it, list it, keep its lease and
  repair it when a worker dies (controller/parameter_servers.py).

The admission queue is not kept: a queued submission is a client's open call, which a restart
ends; the client submits again. A controller started without a state directory keeps the same
records in memory only (``MemoryState``): a restart loses its jobs, as before.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS workers (
    worker_id TEXT PRIMARY KEY, address TEXT NOT NULL, device TEXT NOT NULL, island TEXT NOT NULL,
    host TEXT NOT NULL, alive INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, name TEXT NOT NULL, session TEXT NOT NULL, islands TEXT NOT NULL,
    placement TEXT NOT NULL, namespace TEXT NOT NULL, secret TEXT NOT NULL, state TEXT NOT NULL,
    error TEXT NOT NULL, steps_at_load INTEGER NOT NULL, report TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS journal (
    job_id TEXT NOT NULL, seq INTEGER NOT NULL, request BLOB NOT NULL, loss REAL NOT NULL,
    PRIMARY KEY (job_id, seq));
CREATE TABLE IF NOT EXISTS closed (job_id TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS ps_jobs (
    job_id TEXT PRIMARY KEY, session TEXT NOT NULL, config BLOB NOT NULL, servers TEXT NOT NULL,
    tasks TEXT NOT NULL, chains TEXT NOT NULL, dropped TEXT NOT NULL);
"""


@dataclass(frozen=True, slots=True)
class WorkerRow:
    worker_id: str
    address: str
    device: str
    island: str
    host: str
    alive: bool = True


@dataclass(frozen=True, slots=True)
class JobRow:
    job_id: str
    name: str
    session: str
    islands: tuple[str, ...]
    placement: tuple[str, ...]
    """Worker ids, by worker index."""
    namespace: str
    secret: str
    state: str
    error: str
    steps_at_load: int
    report: dict
    program: bytes = b""
    """The submitted PipelineProgram, serialized (read back at start; written from the message)."""
    journal: tuple[tuple[int, bytes, float], ...] = ()


@dataclass(frozen=True, slots=True)
class PsJobRow:
    job_id: str
    session: str
    config: bytes
    """The job's PsConfig, serialized."""
    servers: tuple[str, ...]
    """Worker ids, by server index; then the tasks' by task index."""
    tasks: tuple[str, ...]
    chains: tuple[tuple[int, ...], ...]
    dropped: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Recorded:
    """All a state directory holds, as read at start."""

    workers: tuple[WorkerRow, ...] = ()
    jobs: tuple[JobRow, ...] = ()
    closed: frozenset[str] = frozenset()
    next_job: int = 0
    ps_jobs: tuple[PsJobRow, ...] = ()


class MemoryState:
    """No state directory: nothing outlives the controller. The recording calls do nothing."""

    path: Path | None = None

    def read(self) -> Recorded:
        return Recorded()

    def next_job(self, number: int) -> None:
        pass

    def worker(self, row: WorkerRow) -> None:
        pass

    def worker_died(self, worker_id: str) -> None:
        pass

    def job_admitted(self, row: JobRow, program) -> None:
        pass

    def job_loaded(self, job_id: str, placement, namespace: str, secret: str, steps_at_load: int, report) -> None:
        pass

    def job_state(self, job_id: str, state: str, error: str = "") -> None:
        pass

    def job_closed(self, job_id: str) -> None:
        pass

    def journal_append(self, job_id: str, seq: int, request, loss: float) -> None:
        pass

    def journal_clear(self, job_id: str) -> None:
        pass

    def ps_job(self, row: PsJobRow) -> None:
        pass

    def ps_job_closed(self, job_id: str) -> None:
        pass

    def close(self) -> None:
        pass


class StateDir(MemoryState):
    """The records in SQLite under ``path`` (created, owner-only: it holds data-plane secrets)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        (self.path / "programs").mkdir(parents=True, exist_ok=True)
        os.chmod(self.path, 0o700)
        self._lock = threading.Lock()  # one connection, used from the controller's threads in turn
        self._db = sqlite3.connect(self.path / "controller.db", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")  # a write appends; readers (none yet) never block it
        self._db.execute("PRAGMA synchronous=FULL")  # a committed change survives the machine, not only the process
        with self._transaction() as db:
            for statement in filter(str.strip, SCHEMA.split(";")):  # executescript would commit midway
                db.execute(statement)
            found = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
            if found is None:
                db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            elif int(found[0]) != SCHEMA_VERSION:
                raise RuntimeError(
                    f"state directory {self.path}: schema version {found[0]}, this controller reads {SCHEMA_VERSION}"
                )

    def _transaction(self):
        return _Transaction(self._db, self._lock)

    def read(self) -> Recorded:
        with self._transaction() as db:
            rows = db.execute("SELECT * FROM workers ORDER BY rowid")
            workers = tuple(WorkerRow(*r[:5], alive=bool(r[5])) for r in rows)
            journal: dict[str, list] = {}
            for job_id, seq, request, loss in db.execute("SELECT * FROM journal ORDER BY job_id, seq"):
                journal.setdefault(job_id, []).append((seq, bytes(request), loss))
            jobs = []
            for job_id, name, session, islands, placement, namespace, secret, state, error, steps, report in db.execute(
                "SELECT * FROM jobs ORDER BY rowid"
            ):
                jobs.append(
                    JobRow(
                        job_id=job_id,
                        name=name,
                        session=session,
                        islands=tuple(json.loads(islands)),
                        placement=tuple(json.loads(placement)),
                        namespace=namespace,
                        secret=secret,
                        state=state,
                        error=error,
                        steps_at_load=steps,
                        report=json.loads(report),
                        program=self._program_file(job_id).read_bytes(),
                        journal=tuple(journal.get(job_id, ())),
                    )
                )
            closed = frozenset(r[0] for r in db.execute("SELECT job_id FROM closed"))
            found = db.execute("SELECT value FROM meta WHERE key = 'next_job'").fetchone()
            ps_jobs = tuple(
                PsJobRow(
                    job_id=job_id,
                    session=session,
                    config=bytes(config),
                    servers=tuple(json.loads(servers)),
                    tasks=tuple(json.loads(tasks)),
                    chains=tuple(tuple(c) for c in json.loads(chains)),
                    dropped=tuple(json.loads(dropped)),
                )
                for job_id, session, config, servers, tasks, chains, dropped in db.execute(
                    "SELECT * FROM ps_jobs ORDER BY rowid"
                )
            )
        return Recorded(workers, tuple(jobs), closed, int(found[0]) if found else 0, ps_jobs)

    def _program_file(self, job_id: str) -> Path:
        return self.path / "programs" / f"{job_id}.pb"

    def next_job(self, number: int) -> None:
        with self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO meta VALUES ('next_job', ?)", (str(number),))

    def worker(self, row: WorkerRow) -> None:
        with self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO workers VALUES (?, ?, ?, ?, ?, ?)", dataclasses.astuple(row))

    def worker_died(self, worker_id: str) -> None:
        with self._transaction() as db:
            db.execute("UPDATE workers SET alive = 0 WHERE worker_id = ?", (worker_id,))

    def job_admitted(self, row: JobRow, program) -> None:
        """A new job: its ``program`` (a PipelineProgram) first, written and synced, then its row."""
        path = self._program_file(row.job_id)
        with open(path.with_suffix(".tmp"), "wb") as f:
            f.write(program.SerializeToString())
            f.flush()
            os.fsync(f.fileno())
        os.replace(path.with_suffix(".tmp"), path)
        with self._transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    row.job_id,
                    row.name,
                    row.session,
                    json.dumps(list(row.islands)),
                    json.dumps(list(row.placement)),
                    row.namespace,
                    row.secret,
                    row.state,
                    row.error,
                    row.steps_at_load,
                    json.dumps(row.report),
                ),
            )

    def job_loaded(self, job_id: str, placement, namespace: str, secret: str, steps_at_load: int, report) -> None:
        """Loaded (again): where, in which data-plane namespace, and from which step on."""
        with self._transaction() as db:
            db.execute(
                "UPDATE jobs SET placement = ?, namespace = ?, secret = ?, steps_at_load = ?, report = ? "
                "WHERE job_id = ?",
                (json.dumps(list(placement)), namespace, secret, steps_at_load, json.dumps(report), job_id),
            )

    def job_state(self, job_id: str, state: str, error: str = "") -> None:
        with self._transaction() as db:
            db.execute("UPDATE jobs SET state = ?, error = ? WHERE job_id = ?", (state, error, job_id))

    def job_closed(self, job_id: str) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,))
            db.execute("DELETE FROM journal WHERE job_id = ?", (job_id,))
            db.execute("INSERT OR REPLACE INTO closed VALUES (?)", (job_id,))
        self._program_file(job_id).unlink(missing_ok=True)

    def journal_append(self, job_id: str, seq: int, request, loss: float) -> None:
        """An auto_resume job's training step ``seq`` (its StepRequest) ended with ``loss``."""
        with self._transaction() as db:
            row = (job_id, seq, request.SerializeToString(), loss)
            db.execute("INSERT OR REPLACE INTO journal VALUES (?, ?, ?, ?)", row)

    def journal_clear(self, job_id: str) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM journal WHERE job_id = ?", (job_id,))

    def ps_job(self, row: PsJobRow) -> None:
        """A parameter-server job as it stands now (loaded, or its chains changed)."""
        with self._transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO ps_jobs VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    row.job_id,
                    row.session,
                    row.config,
                    json.dumps(list(row.servers)),
                    json.dumps(list(row.tasks)),
                    json.dumps([list(c) for c in row.chains]),
                    json.dumps(list(row.dropped)),
                ),
            )

    def ps_job_closed(self, job_id: str) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM ps_jobs WHERE job_id = ?", (job_id,))

    def close(self) -> None:
        with self._lock:
            self._db.close()


class _Transaction:
    """``with``: one transaction under the lock; committed at the end, rolled back on an error."""

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock):
        self._db, self._lock = db, lock

    def __enter__(self) -> sqlite3.Connection:
        self._lock.acquire()
        self._db.execute("BEGIN IMMEDIATE")
        return self._db

    def __exit__(self, kind, *_) -> None:
        try:
            self._db.execute("COMMIT" if kind is None else "ROLLBACK")
        finally:
            self._lock.release()
