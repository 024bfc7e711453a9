"""Readable views of what the controller reports: a job's plan and the cluster's status."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

_ROLES = ("colwise", "rowwise", "vocab_embedding", "vocab_head")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


@dataclass(frozen=True, slots=True)
class Plan:
    """A compiled pipeline: placement, per-rank actions, the rank x time grid, predicted memory.

    ``report`` holds everything as plain data; the properties are conveniences over it.
    """

    report: dict

    @property
    def actions(self) -> dict[int, list[str]]:
        return {int(r): a for r, a in self.report["actions"].items()}

    @property
    def predicted_memory(self) -> dict[int, dict[str, int]]:
        """Per rank: peak bytes split into parameters, gradients, optimizer, activations, buffers."""
        return {int(r): m for r, m in self.report["predicted_memory"].items()}

    @property
    def predicted_communication(self) -> dict[int, dict[str, int]]:
        """Per rank: bytes one training step sends, receives and puts into the gradient all-reduce,
        counted as the workers count their ``data_plane_bytes``."""
        return {int(r): c for r, c in self.report["predicted_communication"].items()}

    @property
    def grid(self) -> list[list[str]]:
        return self.report["grid"]

    def render_grid(self) -> str:
        rows = self.grid
        width = max((len(c) for row in rows for c in row), default=1)
        return "\n".join(f"rank {r}: " + " ".join(c.rjust(width) for c in row) for r, row in enumerate(rows))

    def render(self) -> str:
        r = self.report
        lines = [
            f"schedule {r['schedule']}: {r['ranks']} ranks x {r['virtual_stages']} chunk(s) = "
            f"{r['num_stages']} stages, {r['microbatches']} microbatches"
            + (", rematerialized" if r["rematerialize"] else "")
            + (f"; {r['data_parallel']} data-parallel replicas" if r["data_parallel"] > 1 else "")
        ]
        choice = r.get("schedule_choice")
        if choice:  # schedule="auto": every candidate's prediction, and why this one
            predicted = ", ".join(f"{c['schedule']} {c['predicted_step_s']:.4g}" for c in choice["candidates"])
            lines.append(f"auto ({choice['costs']} costs): {predicted}; {choice['why']}")
        layout = r["layout"]
        lines.append(
            f"layout: pipeline {layout['pipeline']} x tensor {layout['tensor']} x data {layout['data']} "
            f"= {layout['workers']} workers" + (", sequence-parallel" if layout.get("sequence_parallel") else "")
        )
        for s in r["stages"]:
            where = r["placement"].get(str(s["rank"]), f"rank {s['rank']}")
            stash = _mib(s["stashed_bytes_per_microbatch"])
            lines.append(
                f"  stage {s['stage']} on {where}: modules {','.join(m or '(model)' for m in s['modules'])}  "
                f"{s['input']} -> {s['output']}  {s['forward_flops'] / 1e6:.1f} MFLOP fwd, "
                f"params {_mib(s['parameter_bytes'])} MiB, stash/mb {stash} MiB"
            )
            if "tensor_parallel" in s:  # how the stage is cut over its island
                by_role: dict[str, list[str]] = {}
                for module, role in s["tensor_parallel"]["modules"].items():
                    key = role if role in _ROLES else "replicated"
                    by_role.setdefault(key, []).append(module if key != "replicated" else f"{module} ({role})")
                for role, modules in sorted(by_role.items()):
                    lines.append(f"    {role}: {', '.join(modules)}")
                coll = s["tensor_parallel"]["collectives_per_microbatch"]
                counts = ", ".join(f"{len(v)} {k.replace('_', ' ')}" for k, v in coll.items() if v)
                lines.append(f"    island all-reduces per microbatch: {counts}")
        if r.get("edges"):  # present once the plan is placed on workers
            hops = [
                f"{e['from_stage']}->{e['to_stage']} rank {e['from_rank']}->{e['to_rank']} {e['transport']}"
                + (" (skip)" if e.get("skip") else "")
                + (f" ({e['edge']})" if e["edge"].startswith("tied") else "")
                for e in r["edges"]
            ]
            lines.append("  edges: " + ", ".join(hops))
        if r["placement"] and layout["workers"] > r["ranks"]:  # worker (d * ranks + k) * T + t
            T = layout["tensor"]
            for d in range(layout["data"]):
                where = [
                    "+".join(r["placement"].get(str((d * r["ranks"] + k) * T + t), "?").split()[0] for t in range(T))
                    for k in range(r["ranks"])
                ]
                lines.append(f"  replica {d}, rank by rank: {', '.join(where)}")
        if r.get("tied_parameters"):
            tied = [f"{name} on stages {','.join(map(str, stages))}" for name, stages in r["tied_parameters"].items()]
            lines.append("  tied parameters (gradients summed before each update): " + "; ".join(tied))
        lines.append(
            f"predicted bubble fraction {r['predicted_bubble_fraction']:.3f} (F=1, B=2 time units); '.' marks a bubble:"
        )
        lines.append(self.render_grid())
        lines.append("predicted peak MiB per rank: params grads optim activations buffers = total (stashed mbs)")
        for rank, m in sorted(self.predicted_memory.items()):
            lines.append(
                f"  rank {rank}: {_mib(m['parameters'])} {_mib(m['gradients'])} {_mib(m['optimizer'])} "
                f"{_mib(m['activations'])} {_mib(m['buffers'])} = {_mib(m['total'])} "
                f"({m['peak_stashed_microbatches']})"
            )
        lines.append(
            "predicted bytes per training step and rank: sent / received / all-reduced across replicas / "
            "all-reduced in the island"
        )
        for rank, c in sorted(self.predicted_communication.items()):
            lines.append(
                f"  rank {rank}: {c['sent']} / {c['received']} / {c['all_reduced']} / {c['island_all_reduced']}"
            )
        return "\n".join(lines)

    __str__ = render


def _from_pb(view, message, **given):
    """A status view from its message: every field of the view not ``given`` is the message's field
    of the same name (a repeated one as a tuple), so no field is listed twice."""
    values = {}
    for f in fields(view):
        if f.name not in given:
            value = getattr(message, f.name)
            values[f.name] = tuple(value) if f.type.startswith("tuple") else value
    return view(**values, **given)


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    workers: tuple[WorkerStatus, ...]
    jobs: tuple[JobStatus, ...]
    queue: tuple[QueuedRequest, ...] = ()

    @classmethod
    def from_pb(cls, reply) -> ClusterStatus:
        """From the controller's StatusReply."""
        return cls(
            workers=tuple(_from_pb(WorkerStatus, w) for w in reply.workers),
            jobs=tuple(_from_pb(JobStatus, j, last_loss=j.last_loss if j.has_loss else None) for j in reply.jobs),
            queue=tuple(_from_pb(QueuedRequest, q) for q in reply.queue),
        )

    def islands(self) -> dict[str, list[WorkerStatus]]:
        """The workers of each island, islands by name."""
        out: dict[str, list[WorkerStatus]] = {}
        for w in sorted(self.workers, key=lambda w: w.island):
            out.setdefault(w.island, []).append(w)
        return out

    def to_dict(self) -> dict:
        """Everything as plain data (``atoll status --json``): islands, workers, jobs, queue."""
        return {
            "islands": [
                {
                    "name": name,
                    "workers": [w.worker_id for w in members],
                    "alive": sum(w.alive for w in members),
                    "devices": sorted({w.device for w in members}),
                }
                for name, members in self.islands().items()
            ],
            "workers": [asdict(w) for w in self.workers],
            "jobs": [asdict(j) for j in self.jobs],
            "queue": [asdict(q) for q in self.queue],
        }

    def render(self) -> str:
        lines = [f"islands ({len(self.islands())}):"]
        for name, members in self.islands().items():
            devices = ",".join(sorted({w.device for w in members}))
            ids = ",".join(w.worker_id for w in members)
            lines.append(
                f"  {name or '-'}: {ids} alive={sum(w.alive for w in members)}/{len(members)} devices={devices}"
            )
        lines.append(f"workers ({sum(w.alive for w in self.workers)} alive):")
        for w in self.workers:
            state = "returning" if w.returning else "alive" if w.alive else "dead"
            memory = f"rss {_mib(w.rss_bytes)} MiB" if w.rss_bytes else "rss -"
            lines.append(
                f"  {w.worker_id:5} {state:5} {w.device:7} {w.address:21} host={w.host} island={w.island} pid={w.pid} "
                f"{memory}  heartbeat {w.seconds_since_heartbeat:.1f}s ago  jobs={','.join(w.jobs) or '-'}"
                + (f"  steps running {w.running_steps}" if w.running_steps else "")
            )
        lines.append(f"jobs ({len(self.jobs)}):")
        for j in self.jobs:
            loss = "-" if j.last_loss is None else f"{j.last_loss:.4f}"
            measured = _mib(j.measured_peak_bytes) if j.measured_peak_bytes else "-"
            lines.append(
                f"  {j.job_id:6} {j.state:7} {j.name} schedule={j.schedule} stages={j.stages} "
                f"steps={j.steps} ({j.steps_per_s:.1f}/s) loss={loss} "
                f"peak MiB predicted/measured={_mib(j.predicted_peak_bytes)}/{measured} workers={','.join(j.workers)}"
                + (" exclusive" if j.exclusive else "")
                + (f" resident base {j.base_name!r}" if j.base_name else "")
                + (f" on base {j.base!r}" if j.base else "")
                + (f"  error: {j.error}" if j.error else "")
            )
        lines.append(f"admission queue ({len(self.queue)}):")
        for i, q in enumerate(self.queue):
            where = f" islands={','.join(x or '*' for x in q.islands)}" if any(q.islands) else ""
            lines.append(
                f"  {i + 1}. {q.name} needs {q.ranks} {q.device} workers{where}"
                + (" exclusive" if q.exclusive else "")
                + f", waiting {q.waited_s:.1f}s"
            )
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One registered worker, as the controller sees it."""

    worker_id: str
    address: str
    """Where the worker's daemon serves gRPC (host:port)."""
    device: str
    host: str
    alive: bool
    """False once its heartbeats stopped for longer than the controller's deadline."""
    seconds_since_heartbeat: float
    jobs: tuple[str, ...]
    """The jobs loaded on it."""
    pid: int
    island: str
    rss_bytes: int = 0
    """Resident memory of the worker's process at its last heartbeat (0: not reported yet)."""
    returning: bool = False
    """Known from a restarted controller's state directory, and not registered again yet (not alive)."""
    running_steps: int = 0
    """Step calls running on it at its last heartbeat, one stuck in the data plane for a failed job
    included (it ends at that wait's deadline, or when the peer it waits for goes away)."""


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """A job waiting in the admission queue for its workers."""

    name: str
    """The job's name (``pipeline(..., name=...)``, else its model's class)."""
    ranks: int
    """How many workers it asks for."""
    device: str
    """The device kind its workers must have (cpu, cuda)."""
    islands: tuple[str, ...]
    """Per rank, the island its worker must be on ("": any)."""
    exclusive: bool
    """It asks for workers no other job uses."""
    waited_s: float
    """Seconds since it was queued."""


@dataclass(frozen=True, slots=True)
class JobStatus:
    """A job as ``atoll status`` shows it."""

    job_id: str
    name: str
    state: str
    """loading, ready, failed or closed."""
    workers: tuple[str, ...]
    """Its workers in rank order."""
    steps: int
    schedule: str
    stages: int
    error: str
    """Why it failed ("" while healthy)."""
    steps_per_s: float
    exclusive: bool
    last_loss: float | None = None
    """Mean microbatch loss of the last training step (None before the first)."""
    predicted_peak_bytes: int = 0
    """The plan's largest predicted per-rank peak."""
    measured_peak_bytes: int = 0
    """The largest per-worker peak measured in the last training step (0: no step yet)."""
    base_name: str = ""
    """The resident base this job is (``Client.load_base``), or ""."""
    base: str = ""
    """The resident base this job trains adapters on (``Client.lora``), or ""."""
