"""The one validated description of where a job's stages run: its layout (pipeline x tensor x data),
in the spirit of torchtitan's ParallelDims."""

from __future__ import annotations

from dataclasses import dataclass, field

from atoll.core.mesh import Mesh
from atoll.core.names import SCHEDULES, V_SCHEDULES
from atoll.errors import InvalidInput


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """Pipeline ranks x model chunks x microbatches; fails loudly when built with bad values."""

    ranks: int
    """Pipeline ranks, one worker each."""
    virtual_stages: int = 1
    """Model chunks per rank; stage ``s`` runs on rank ``s % ranks`` (Megatron's interleaving), or,
    under the V-shaped "zbv" and "dualpipev", on rank ``s`` on the way down and ``2 * ranks - 1 - s`` on the way up."""
    microbatches: int
    """Microbatches per step."""
    schedule: str = "gpipe"
    """One of SCHEDULES."""
    data_parallel: int = 1
    """Replicas of the pipeline."""
    tensor_parallel: int = 1
    """Workers per pipeline rank (the island each stage is sharded over). Replica ``d``'s rank ``r``
    runs on workers ``(d * ranks + r) * tensor_parallel + t``, t = 0 .. tensor_parallel - 1: an
    island's workers are neighbours in placement order (same host first), as in Megatron-LM."""

    _mesh: Mesh = field(init=False, repr=False, compare=False)
    """Built once, after the checks, from the degrees above."""

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise InvalidInput(f"unknown schedule {self.schedule!r} (known: {', '.join(SCHEDULES)})")
        for name in ("ranks", "virtual_stages", "microbatches", "data_parallel", "tensor_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidInput(f"{name} must be a positive integer, got {value!r}")
        if self.schedule in V_SCHEDULES and self.virtual_stages != 2:
            raise InvalidInput(
                f"schedule {self.schedule!r} runs two model chunks per rank in a V: "
                f"give virtual_stages=2, got {self.virtual_stages}"
            )
        if self.schedule not in ("interleaved_1f1b", *V_SCHEDULES) and self.virtual_stages != 1:
            raise InvalidInput(
                f"schedule {self.schedule!r} runs one stage per rank; virtual_stages={self.virtual_stages} "
                "needs 'interleaved_1f1b' (or 2 with 'zbv' or 'dualpipev')"
            )
        if self.schedule == "dualpipev" and self.microbatches < 2 * self.ranks:
            raise InvalidInput(
                f"dualpipev needs at least as many microbatches as stages ({2 * self.ranks}), got {self.microbatches}"
            )
        if self.schedule == "interleaved_1f1b":
            if self.microbatches % self.rounds:
                raise InvalidInput(
                    f"interleaved_1f1b needs microbatches divisible by the number of rounds "
                    f"({self.rounds} = max(1, microbatches // ranks)), got {self.microbatches}"
                )
        mesh = Mesh.of(data=self.data_parallel, pipeline=self.ranks, tensor=self.tensor_parallel)
        object.__setattr__(self, "_mesh", mesh)  # frozen: set once here

    @property
    def workers(self) -> int:
        return self.ranks * self.tensor_parallel * self.data_parallel

    @property
    def mesh(self) -> Mesh:
        """The workers as named dimensions (atoll.core.mesh): what each worker's plan carries."""
        return self._mesh

    def worker(self, replica: int, rank: int, tp: int = 0) -> int:
        return self.mesh.worker(data=replica, pipeline=rank, tensor=tp)

    def coordinates(self, worker: int) -> tuple[int, int, int]:
        """(replica, pipeline rank, rank in the island) of a worker index."""
        at = self.mesh.coordinates(worker)
        return at["data"], at["pipeline"], at["tensor"]

    def pipeline_workers(self, replica: int, tp: int) -> list[int]:
        """The workers forming one chain of the pipeline: island rank ``tp`` of every stage of a replica."""
        return [self.worker(replica, r, tp) for r in range(self.ranks)]

    @property
    def num_stages(self) -> int:
        return self.ranks * self.virtual_stages

    @property
    def rounds(self) -> int:
        return max(1, self.microbatches // self.ranks)

    @property
    def microbatches_per_round(self) -> int:
        return self.microbatches // self.rounds

    def rank_of(self, stage: int) -> int:
        if self.schedule in V_SCHEDULES and stage >= self.ranks:  # the V's way back up
            return 2 * self.ranks - 1 - stage
        return stage % self.ranks

    def stages_of(self, rank: int) -> list[int]:
        if self.schedule in V_SCHEDULES:
            return [rank, 2 * self.ranks - 1 - rank]
        return [rank + chunk * self.ranks for chunk in range(self.virtual_stages)]

    @property
    def stage_ranks(self) -> list[int]:
        return [self.rank_of(s) for s in range(self.num_stages)]
