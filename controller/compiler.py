"""The compiler: a submitted pipeline program -> a plan that is known in full before it runs.

Passes, in order: analyze blocks (specs, cost on fake tensors) -> check the chain of edges -> partition
into stages by cost -> build the schedule (data) -> lower it (SEND/RECV, receive slots) ->
simulate it (deadlocks, timeline) -> predict each worker's peak memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from atoll._graphs import BlockGraph, StageGraph, deserialize
from atoll._optim import validate_optimizer
from atoll._wire import EdgeSpec, TensorSpec
from atoll.controller import memory_plan
from atoll.controller.lowering import Lowered, lower
from atoll.controller.partition import balanced_partition, explicit_partition
from atoll.controller.program import BlockInfo, analyze_block, analyze_loss, check_chain
from atoll.controller.schedules import build_schedule
from atoll.controller.simulate import Timeline, simulate
from atoll.controller.topology import Topology
from atoll.errors import InvalidInput


@dataclass(kw_only=True, slots=True)
class PipelineRequest:
    """A submitted pipeline program, decoded from the wire."""

    blocks: list[tuple[str, bytes]]
    """(name, serialized exported program) per top-level block, in execution order."""
    loss: bytes
    """Serialized exported loss program: (last block output, target microbatch) -> scalar."""
    ranks: int
    """Pipeline ranks, one worker each."""
    microbatches: int
    """Microbatches per step."""
    input: EdgeSpec
    """Full-batch input spec."""
    target: EdgeSpec
    """Full-batch target spec."""
    schedule: str = "gpipe"
    """Schedule name (controller.topology.SCHEDULE_NAMES)."""
    virtual_stages: int = 1
    """Model chunks per rank (interleaved schedules)."""
    optimizer: str = "sgd"
    """Optimizer name (atoll._optim.OPTIMIZERS)."""
    optimizer_args: dict = field(default_factory=dict)
    """Plain keyword arguments of the optimizer."""
    split_points: list[int] = field(default_factory=list)
    """Explicit indices of the first block of each stage after the first; empty: balance by cost."""
    rematerialize: bool = False
    """Recompute each stage's forward during backward instead of stashing its activations."""
    name: str = ""
    """A label shown by status."""
    data_plane_timeout_s: float = 60.0
    """Deadline of every data-plane wait (receive, send completion, group join)."""
    device: str = "cpu"
    """Device kind of the workers the job runs on: "cpu" or "cuda"."""
    transport: str = "auto"
    """"auto": each edge's transport follows from placement; or one of TRANSPORTS for every edge."""


DEVICE_KINDS = ("cpu", "cuda")
TRANSPORTS = ("gloo", "cuda_ipc", "nccl")


def analysis_device(device: str) -> str:
    """The device whose kernels the fake-tensor analysis runs: the job's, when this process has it.

    Fake CUDA tensors need a CUDA build of torch (no GPU memory is used); a controller without one
    analyzes a CUDA job with CPU kernels, and the plan says so (memory may then differ a little,
    e.g. where attention takes another fused kernel)."""
    if device == "cuda" and not torch.cuda.is_available():
        return "cpu"
    return device


@dataclass(frozen=True, kw_only=True, slots=True)
class CompiledStage:
    index: int
    rank: int
    blocks: list[BlockInfo]
    input: EdgeSpec
    output: EdgeSpec
    memory: memory_plan.StageMemory

    @property
    def forward_flops(self) -> int:
        return sum(b.forward_flops for b in self.blocks)


@dataclass(frozen=True, kw_only=True, slots=True)
class CompiledPipeline:
    request: PipelineRequest
    topology: Topology
    stages: list[CompiledStage]
    lowered: Lowered
    timeline: Timeline
    memory: dict[int, memory_plan.RankMemory]
    microbatch_input: EdgeSpec
    microbatch_target: EdgeSpec

    def report(self, placement: dict[int, str] | None = None) -> dict:
        """The plan as plain data: placement, per-rank actions and grid, predicted memory."""
        t = self.topology
        return {
            "schedule": t.schedule,
            "ranks": t.ranks,
            "virtual_stages": t.virtual_stages,
            "microbatches": t.microbatches,
            "num_stages": t.num_stages,
            "rematerialize": self.request.rematerialize,
            "device": self.request.device,
            "analysis_device": analysis_device(self.request.device),
            "placement": {str(r): w for r, w in (placement or {}).items()},
            "stages": [
                {
                    "stage": s.index,
                    "rank": s.rank,
                    "blocks": [b.name for b in s.blocks],
                    "input": str(s.input),
                    "output": str(s.output),
                    "forward_flops": s.forward_flops,
                    "parameter_bytes": s.memory.parameter_bytes,
                    "stashed_bytes_per_microbatch": s.memory.stashed_bytes,
                    "recomputed_bytes_per_microbatch": s.memory.recomputed_bytes,
                }
                for s in self.stages
            ],
            "actions": {str(r): [str(a) for a in acts] for r, acts in self.lowered.actions.items()},
            "grid": self.timeline.grid(),
            "predicted_bubble_fraction": self.timeline.bubble_fraction,
            "predicted_memory": {
                str(r): {**m.peak.as_dict(), "peak_stashed_microbatches": m.peak_stashed_microbatches}
                for r, m in self.memory.items()
            },
        }


def microbatch_spec(full: EdgeSpec, microbatches: int) -> EdgeSpec:
    tensors = []
    for t in full.tensors:
        if not t.shape or t.shape[0] % microbatches:
            raise InvalidInput(
                f"edge '{full.name}': batch dimension of {t} is not divisible into {microbatches} microbatches"
            )
        tensors.append(TensorSpec((t.shape[0] // microbatches, *t.shape[1:]), t.dtype))
    return EdgeSpec(full.name, tuple(tensors))


def compile_pipeline(req: PipelineRequest) -> CompiledPipeline:
    topo = Topology(
        ranks=req.ranks, virtual_stages=req.virtual_stages, microbatches=req.microbatches, schedule=req.schedule
    )
    validate_optimizer(req.optimizer, req.optimizer_args)
    if not req.data_plane_timeout_s > 0:
        raise InvalidInput(f"data_plane_timeout_s must be positive, got {req.data_plane_timeout_s}")
    if not req.blocks:
        raise InvalidInput("the program has no blocks")
    if req.device not in DEVICE_KINDS:
        raise InvalidInput(f"unknown device kind {req.device!r} (known: {', '.join(DEVICE_KINDS)})")
    if req.transport != "auto" and req.transport not in TRANSPORTS:
        raise InvalidInput(f"unknown transport {req.transport!r} (known: auto, {', '.join(TRANSPORTS)})")
    device = analysis_device(req.device)
    analyzed = [analyze_block(i, name, data) for i, (name, data) in enumerate(req.blocks)]
    infos = [info for info, _ in analyzed]
    check_chain(infos)
    mb_input = microbatch_spec(req.input, req.microbatches)
    mb_target = microbatch_spec(req.target, req.microbatches)
    if infos[0].input.tensors != mb_input.tensors:
        raise InvalidInput(
            f"the first block was exported with {infos[0].input}, but a microbatch of the input is {mb_input}"
        )
    loss = analyze_loss(req.loss, infos[-1].output, mb_target)

    if req.split_points:
        ranges = explicit_partition(len(infos), req.split_points, topo.num_stages)
    else:
        ranges = balanced_partition([b.cost for b in infos], topo.num_stages)

    def private(blocks: list[int]) -> tuple[StageGraph, BlockGraph]:
        """Copies the CUDA analysis may move in place; on CPU the analyzed graphs themselves."""
        if device == "cpu":
            return StageGraph([analyzed[i][1] for i in blocks]), loss
        fresh = [BlockGraph(infos[i].name, deserialize(infos[i].data, infos[i].name)) for i in blocks]
        return StageGraph(fresh), BlockGraph("loss", deserialize(req.loss, "loss program"))

    stages = []
    for s, blocks in enumerate(ranges):
        graph, stage_loss = private(blocks)
        is_last = s == topo.num_stages - 1
        memory = memory_plan.measure_stage(
            graph,
            s,
            infos[blocks[0]].input,
            stage_loss if is_last else None,
            mb_target if is_last else None,
            req.rematerialize,
            device,
        )
        stages.append(
            CompiledStage(
                index=s,
                rank=topo.rank_of(s),
                blocks=[infos[i] for i in blocks],
                input=infos[blocks[0]].input,
                output=infos[blocks[-1]].output,
                memory=memory,
            )
        )

    def carries_grad(edge: int) -> bool:
        return bool(stages[edge].output.differentiable)

    lowered = lower(build_schedule(topo), topo, carries_grad)
    timeline = simulate(lowered.actions, topo, carries_grad=carries_grad)
    stage_params = {
        s: [p for _, p in StageGraph([analyzed[i][1] for i in r]).named_parameters()] for s, r in enumerate(ranges)
    }
    memory = memory_plan.predict(
        topo,
        lowered,
        {s.index: s.memory for s in stages},
        stage_params,
        req.optimizer,
        req.optimizer_args,
        {s.index: s.input for s in stages},
        {s.index: s.output for s in stages},
    )
    return CompiledPipeline(
        request=req,
        topology=topo,
        stages=stages,
        lowered=lowered,
        timeline=timeline,
        memory=memory,
        microbatch_input=mb_input,
        microbatch_target=mb_target,
    )
