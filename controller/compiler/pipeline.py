"""The compiler: a submitted pipeline program -> a plan that is known in full before it runs.

``compile_pipeline`` runs the passes of controller/compiler/passes.py (``PASSES``) over one
compile state: validate the settings -> microbatch specs -> split the exported model into stages
and the dataflow graph -> shard them (tensor parallelism) -> analyze each stage program (specs,
cost on fake tensors) -> measure each stage's memory -> build the schedule (data) and lower it per
edge -> simulate it (deadlocks, timeline) -> predict each worker's peak memory and bytes moved.
Placement on workers comes after (controller/cluster/placement.py), and picks each edge's transport
(controller/cluster/transports.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from atoll.controller.compiler import autoschedule
from atoll.controller.compiler import memory as memory_plan
from atoll.controller.compiler.lowering import Lowered
from atoll.controller.compiler.parallel.tensor import ShardedStage
from atoll.controller.compiler.parallel.tensor.inventory import whole_warning
from atoll.controller.compiler.passes import PASSES, CompileState, analysis_device, microbatch_spec
from atoll.controller.compiler.program import StageInfo
from atoll.controller.compiler.report import EdgeReport, LayoutReport, PlanReport, StageReport
from atoll.controller.compiler.simulate import Timeline
from atoll.controller.compiler.topology import Topology
from atoll.core.config import JobConfig
from atoll.core.dataflow import BATCH, Dataflow, Routes
from atoll.core.shards import ParamShard
from atoll.core.wire import EdgeSpec

__all__ = [
    "CompiledPipeline",
    "CompiledStage",
    "PipelineRequest",
    "analysis_device",
    "compile_pipeline",
    "microbatch_spec",
]


@dataclass(kw_only=True, slots=True)
class PipelineRequest:
    """A submitted pipeline program, decoded from the wire."""

    model: bytes
    """The whole model, serialized with torch.export at the microbatch shape."""
    loss: bytes
    """Serialized exported loss program: (model output, target microbatch) -> scalar."""
    input: EdgeSpec
    """Full-batch input spec."""
    target: EdgeSpec
    """Full-batch target spec."""
    config: JobConfig
    """Every setting of the job."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Other names of the model's shared tensors (tied weights) -> their first name."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CompiledStage:
    index: int
    rank: int
    modules: tuple[str, ...]
    start: str
    """Where it starts, as an exact split point (SplitStage.start)."""
    info: StageInfo
    memory: memory_plan.StageMemory
    programs: tuple[bytes, ...]
    """Per rank of the stage's island: its exported program (one, unsharded, without tensor parallelism)."""
    sharding: ShardedStage | None = None
    """How tensor parallelism cut the stage (None without it)."""

    @property
    def input(self) -> EdgeSpec:
        return self.info.input

    @property
    def output(self) -> EdgeSpec:
        return self.info.output

    @property
    def forward_flops(self) -> int:
        return self.info.forward_flops


@dataclass(frozen=True, kw_only=True, slots=True)
class CompiledPipeline:
    request: PipelineRequest
    topology: Topology
    dataflow: Dataflow
    routes: Routes
    """The dataflow placed on the topology's ranks."""
    batch_ranks: frozenset[int]
    """Ranks running a stage that reads the batch input (they are sent each step's input)."""
    stages: list[CompiledStage]
    lowered: Lowered
    timeline: Timeline
    memory: dict[int, memory_plan.RankMemory]
    communication: dict[int, dict[str, int]]
    """Per rank: the bytes one training step moves (controller/compiler/communication.py)."""
    schedule_choice: autoschedule.Choice | None
    """With schedule="auto": the candidates' predictions and why the chosen one won."""
    microbatch_input: EdgeSpec
    microbatch_target: EdgeSpec
    loss_programs: tuple[bytes, ...]
    """Per island rank of the last stage: the loss program (a vocabulary-parallel cross-entropy
    where the logits stay sharded; else the submitted loss, the same for every rank)."""

    @property
    def output_dims(self) -> dict[int, int]:
        """Model output position -> the dimension the island's ranks each hold a slice of."""
        last = self.stages[-1].sharding
        return last.output_dims if last is not None else {}

    @property
    def cuts(self) -> dict[str, ParamShard]:
        """Every parameter tensor parallelism cuts, and how (tied copies are cut alike)."""
        return {n: c for s in self.stages if s.sharding for n, c in s.sharding.params.items()}

    def plan_report(self, placement: dict[int, str] | None = None) -> PlanReport:
        """The plan as typed records: placement, stages, edges, per-rank actions and grid, memory."""
        return build_report(self, placement or {})

    def report(self, placement: dict[int, str] | None = None) -> dict:
        """``plan_report`` as plain data (what the wire and ``atoll plan --json`` carry)."""
        return self.plan_report(placement).to_dict()


def compile_pipeline(req: PipelineRequest) -> CompiledPipeline:
    """Run every pass (controller/compiler/passes.py, ``PASSES``) over one state; the result is
    known in full before anything runs."""
    st = CompileState(req, req.config)
    for compiler_pass in PASSES:
        compiler_pass(st)
    return CompiledPipeline(**{f.name: getattr(st, f.name) for f in dataclasses.fields(CompiledPipeline)})


_FROM_TOPOLOGY = (
    "schedule",
    "ranks",
    "virtual_stages",
    "microbatches",
    "data_parallel",
    "tensor_parallel",
    "num_stages",
)


def build_report(c: CompiledPipeline, placement: dict[int, str]) -> PlanReport:
    t, cfg = c.topology, c.request.config
    return PlanReport(
        **{name: getattr(t, name) for name in _FROM_TOPOLOGY},
        layout=LayoutReport(
            pipeline=t.ranks,
            tensor=t.tensor_parallel,
            data=t.data_parallel,
            workers=t.workers,
            sequence_parallel=cfg.sequence_parallel,
        ),
        rematerialize=cfg.rematerialize,
        device=cfg.device,
        analysis_device=analysis_device(cfg.device),
        placement={str(r): w for r, w in placement.items()},
        stages=[
            StageReport(
                stage=s.index,
                rank=s.rank,
                modules=list(s.modules),
                input=str(s.input),
                output=str(s.output),
                forward_flops=s.forward_flops,
                parameter_bytes=s.memory.parameter_bytes,
                stashed_bytes_per_microbatch=s.memory.stashed_bytes,
                recomputed_bytes_per_microbatch=s.memory.recomputed_bytes,
                tensor_parallel=None
                if s.sharding is None
                else {
                    "modules": s.sharding.modules,
                    "sharded_parameters": {n: p.to_json() for n, p in s.sharding.params.items()},
                    "sharded_fraction": s.sharding.coverage,
                    "whole_linear_layers": s.sharding.whole,
                    "collectives_per_microbatch": s.sharding.collectives,
                },
            )
            for s in c.stages
        ],
        dataflow=[
            EdgeReport(
                from_stage="input" if e.src == BATCH else e.src,
                to_stage=e.dst,
                tensors=str(e.spec),
                kind="batch" if e.src == BATCH else ("local" if c.routes.is_local(e) else "remote"),
                skip=e.skips,
            )
            for e in c.dataflow.edges
        ],
        tied_parameters={p.name: list(p.stages) for p in c.dataflow.tied},
        aliases=dict(c.request.aliases),
        actions={str(r): [str(a) for a in acts] for r, acts in c.lowered.actions.items()},
        grid=c.timeline.grid(),
        predicted_bubble_fraction=c.timeline.bubble_fraction,
        predicted_communication={str(r): m for r, m in c.communication.items()},
        predicted_memory={
            str(r): {
                **m.peak.as_dict(),
                "peak_stashed_microbatches": m.peak_stashed_microbatches,
                **({"at_step": m.at_step.as_dict()} if m.at_step is not None else {}),
            }
            for r, m in c.memory.items()
        },
        warnings=[w for s in c.stages if s.sharding is not None and (w := whole_warning(s.index, s.sharding))],
        schedule_choice=None if c.schedule_choice is None else c.schedule_choice.to_dict(),
    )
