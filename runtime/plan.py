"""Readable views of what the controller reports: a job's plan and the cluster's status."""

from __future__ import annotations

from dataclasses import dataclass

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
                + (" (skip)" if e["to_stage"] - e["from_stage"] > 1 else "")
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


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    worker_id: str
    address: str
    device: str
    host: str
    alive: bool
    seconds_since_heartbeat: float
    jobs: tuple[str, ...]
    pid: int
    island: str


@dataclass(frozen=True, slots=True)
class JobStatus:
    job_id: str
    name: str
    state: str
    workers: tuple[str, ...]
    steps: int
    schedule: str
    stages: int
    error: str
    steps_per_s: float
    exclusive: bool


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """A job waiting in the admission queue for its workers."""

    name: str
    ranks: int
    device: str
    islands: tuple[str, ...]
    exclusive: bool
    waited_s: float


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    workers: tuple[WorkerStatus, ...]
    jobs: tuple[JobStatus, ...]
    queue: tuple[QueuedRequest, ...] = ()

    def render(self) -> str:
        lines = [f"workers ({sum(w.alive for w in self.workers)} alive):"]
        for w in self.workers:
            state = "alive" if w.alive else "dead"
            lines.append(
                f"  {w.worker_id:5} {state:5} {w.device:7} {w.address:21} host={w.host} island={w.island} pid={w.pid} "
                f"heartbeat {w.seconds_since_heartbeat:.1f}s ago  jobs={','.join(w.jobs) or '-'}"
            )
        lines.append(f"jobs ({len(self.jobs)}):")
        for j in self.jobs:
            lines.append(
                f"  {j.job_id:6} {j.state:7} {j.name} schedule={j.schedule} stages={j.stages} "
                f"steps={j.steps} ({j.steps_per_s:.1f}/s) workers={','.join(j.workers)}"
                + (" exclusive" if j.exclusive else "")
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
