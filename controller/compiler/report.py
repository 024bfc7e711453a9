"""The plan report: what the compiler decided and predicts for a job, as typed records. Its dict
(``PlanReport.to_dict``) is what ``atoll plan --json``, ``Job.plan`` and the controller's GetPlan show."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutReport:
    pipeline: int
    tensor: int
    data: int
    workers: int
    sequence_parallel: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class StageReport:
    stage: int
    rank: int
    modules: list[str]
    input: str
    output: str
    forward_flops: int
    parameter_bytes: int
    stashed_bytes_per_microbatch: int
    recomputed_bytes_per_microbatch: int
    tensor_parallel: dict | None = None
    """How tensor parallelism cut the stage (absent from the dict without it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EdgeReport:
    from_stage: int | str
    """A stage, or "input" for the batch."""
    to_stage: int
    tensors: str
    kind: str
    """"batch", "local" (a hand-off on one rank) or "remote" (over a transport)."""
    skip: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanReport:
    schedule: str
    ranks: int
    virtual_stages: int
    microbatches: int
    data_parallel: int
    tensor_parallel: int
    layout: LayoutReport
    num_stages: int
    rematerialize: bool
    device: str
    analysis_device: str
    placement: dict[str, str]
    stages: list[StageReport]
    dataflow: list[EdgeReport]
    tied_parameters: dict[str, list[int]]
    aliases: dict[str, str]
    actions: dict[str, list[str]]
    grid: list[list[str]]
    predicted_bubble_fraction: float
    predicted_communication: dict[str, dict[str, int]] = field(default_factory=dict)
    predicted_memory: dict[str, dict[str, int]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    """What the user should know before training on this plan (the client warns with each)."""
    schedule_choice: dict | None = None
    """With schedule="auto": ``chosen``, ``candidates`` (each schedule's predicted step time and
    bubble), ``costs`` ("measured" or "flops") and ``why``."""

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for stage in out["stages"]:
            if stage["tensor_parallel"] is None:
                del stage["tensor_parallel"]
        return out
