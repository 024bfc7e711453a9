"""The job's workers as a grid of named dimensions, built and validated once by the compiler and
carried in each worker's plan, as torchtitan's ParallelDims and Monarch's meshes name theirs.

Dimensions, slowest-varying first: ``data`` (replicas of the pipeline), ``pipeline`` (its ranks),
``tensor`` (the island each stage is sharded over). A worker's index is row-major over them, so an
island's workers are neighbours in placement order (same host first), as in Megatron-LM. A new kind
of parallelism (experts, context) is one more name in ``DIMENSIONS``.

Each dimension of a worker has a group: the workers that differ from it along that dimension
alone. The group's name is derived here, once, and is where its members meet in the job's
rendezvous namespace; a worker reads its coordinates, the sizes and its groups from its plan and
from nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from atoll._rpc import atoll_pb2 as pb
from atoll.errors import InvalidInput

DIMENSIONS = ("data", "pipeline", "tensor")


@dataclass(frozen=True, slots=True)
class Mesh:
    """Sizes of the named dimensions, in ``DIMENSIONS`` order; every size is a positive integer."""

    sizes: tuple[tuple[str, int], ...]

    @staticmethod
    def of(**sizes: int) -> Mesh:
        unknown = set(sizes) - set(DIMENSIONS)
        if unknown:
            raise InvalidInput(f"unknown mesh dimension {sorted(unknown)} (known: {', '.join(DIMENSIONS)})")
        for name, size in sizes.items():
            if not isinstance(size, int) or size < 1:
                raise InvalidInput(f"mesh dimension {name} must be a positive integer, got {size!r}")
        return Mesh(tuple((name, sizes.get(name, 1)) for name in DIMENSIONS))

    def size(self, dim: str) -> int:
        return dict(self.sizes)[dim]

    @property
    def workers(self) -> int:
        total = 1
        for _, size in self.sizes:
            total *= size
        return total

    def worker(self, **coords: int) -> int:
        """The index of the worker at ``coords`` (a dimension left out is 0)."""
        index = 0
        for name, size in self.sizes:
            c = coords.get(name, 0)
            if not 0 <= c < size:
                raise InvalidInput(f"mesh coordinate {name}={c} is outside 0..{size - 1}")
            index = index * size + c
        return index

    def coordinates(self, worker: int) -> dict[str, int]:
        if not 0 <= worker < self.workers:
            raise InvalidInput(f"worker {worker} is outside the mesh's {self.workers} workers")
        out = {}
        for name, size in reversed(self.sizes):
            worker, out[name] = divmod(worker, size)
        return {name: out[name] for name, _ in self.sizes}

    def group(self, dim: str, worker: int) -> str:
        """Where the workers that differ from ``worker`` along ``dim`` alone meet: e.g.
        ``tensor@data=0,pipeline=1/`` for the island of replica 0's pipeline rank 1."""
        at = self.coordinates(worker)
        return f"{dim}@" + ",".join(f"{n}={c}" for n, c in at.items() if n != dim) + "/"

    def members(self, dim: str, worker: int) -> list[int]:
        """The workers of ``worker``'s group along ``dim``, by their coordinate along it."""
        at = self.coordinates(worker)
        return [self.worker(**{**at, dim: c}) for c in range(self.size(dim))]

    def place(self, worker: int) -> WorkerMesh:
        at = self.coordinates(worker)
        return WorkerMesh(
            worker=worker,
            sizes=dict(self.sizes),
            coordinates=at,
            groups={name: self.group(name, worker) for name, _ in self.sizes},
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerMesh:
    """One worker's place in the mesh: what its plan carries (``pb.MeshPlace``)."""

    worker: int
    sizes: dict[str, int]
    coordinates: dict[str, int]
    groups: dict[str, str]

    def to_pb(self) -> pb.MeshPlace:
        return pb.MeshPlace(
            worker=self.worker,
            dimensions=[
                pb.MeshDimension(name=n, size=s, index=self.coordinates[n], group=self.groups[n])
                for n, s in self.sizes.items()
            ],
        )

    @staticmethod
    def from_pb(msg: pb.MeshPlace) -> WorkerMesh:
        """Raises InvalidInput for a place no mesh has (unknown or repeated dimensions, a coordinate
        outside its size)."""
        names = [d.name for d in msg.dimensions]
        if sorted(names) != sorted(DIMENSIONS):
            raise InvalidInput(f"plan's mesh has dimensions {names}, expected {list(DIMENSIONS)}")
        for d in msg.dimensions:
            if d.size < 1 or not 0 <= d.index < d.size:
                raise InvalidInput(f"plan's mesh: {d.name} index {d.index} is outside 0..{d.size - 1}")
        return WorkerMesh(
            worker=msg.worker,
            sizes={d.name: d.size for d in msg.dimensions},
            coordinates={d.name: d.index for d in msg.dimensions},
            groups={d.name: d.group for d in msg.dimensions},
        )
