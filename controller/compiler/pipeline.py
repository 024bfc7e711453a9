"""The compiler: a submitted pipeline program -> a plan that is known in full before it runs.

Passes, in order: split the exported model into stages and the dataflow graph between them
(controller.split: at submodule boundaries, balanced by cost) -> analyze each stage program (specs,
cost on fake tensors) -> build the schedule (data) -> lower it per edge (SEND/RECV or local
hand-off, receive slots, REDUCE_GRAD for tied parameters) -> simulate it (deadlocks, timeline) ->
predict each worker's peak memory. Placement on workers comes after (controller.service), and
picks each edge's transport (controller.transports).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from atoll.controller.compiler import communication as communication_plan
from atoll.controller.compiler import memory as memory_plan
from atoll.controller.compiler.lowering import Lowered, lower
from atoll.controller.compiler.parallel.tensor import ShardedStage, shard_stage
from atoll.controller.compiler.program import StageInfo, analyze_loss, analyze_stage
from atoll.controller.compiler.schedules import build_schedule
from atoll.controller.compiler.simulate import Timeline, check_islands, island_order, simulate
from atoll.controller.compiler.split import split_model
from atoll.controller.compiler.topology import Topology
from atoll.core.config import DISPATCH_MODES, JobConfig
from atoll.core.dataflow import BATCH, Dataflow, Routes, TiedParameter
from atoll.core.graphs import BlockGraph, StageGraph, deserialize
from atoll.core.optim import validate_optimizer
from atoll.core.shards import ParamShard
from atoll.core.wire import EdgeSpec, TensorSpec
from atoll.errors import InvalidInput


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
    modules: tuple[str, ...]
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

    def report(self, placement: dict[int, str] | None = None) -> dict:
        """The plan as plain data: placement, stages, edges, per-rank actions and grid, memory."""
        t = self.topology
        return {
            "schedule": t.schedule,
            "ranks": t.ranks,
            "virtual_stages": t.virtual_stages,
            "microbatches": t.microbatches,
            "data_parallel": t.data_parallel,
            "tensor_parallel": t.tensor_parallel,
            "layout": {
                "pipeline": t.ranks,
                "tensor": t.tensor_parallel,
                "data": t.data_parallel,
                "workers": t.workers,
                "sequence_parallel": self.request.config.sequence_parallel,
            },
            "num_stages": t.num_stages,
            "rematerialize": self.request.config.rematerialize,
            "device": self.request.config.device,
            "analysis_device": analysis_device(self.request.config.device),
            "placement": {str(r): w for r, w in (placement or {}).items()},
            "stages": [
                {
                    "stage": s.index,
                    "rank": s.rank,
                    "modules": list(s.modules),
                    "input": str(s.input),
                    "output": str(s.output),
                    "forward_flops": s.forward_flops,
                    "parameter_bytes": s.memory.parameter_bytes,
                    "stashed_bytes_per_microbatch": s.memory.stashed_bytes,
                    "recomputed_bytes_per_microbatch": s.memory.recomputed_bytes,
                    **(
                        {
                            "tensor_parallel": {
                                "modules": s.sharding.modules,
                                "sharded_parameters": {n: p.to_json() for n, p in s.sharding.params.items()},
                                "collectives_per_microbatch": s.sharding.collectives,
                            }
                        }
                        if s.sharding is not None
                        else {}
                    ),
                }
                for s in self.stages
            ],
            "dataflow": [
                {
                    "from_stage": "input" if e.src == BATCH else e.src,
                    "to_stage": e.dst,
                    "tensors": str(e.spec),
                    "kind": "batch" if e.src == BATCH else ("local" if self.routes.is_local(e) else "remote"),
                    "skip": e.skips,
                }
                for e in self.dataflow.edges
            ],
            "tied_parameters": {t.name: list(t.stages) for t in self.dataflow.tied},
            "aliases": dict(self.request.aliases),
            "actions": {str(r): [str(a) for a in acts] for r, acts in self.lowered.actions.items()},
            "grid": self.timeline.grid(),
            "predicted_bubble_fraction": self.timeline.bubble_fraction,
            "predicted_communication": {str(r): c for r, c in self.communication.items()},
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
    cfg = req.config
    topo = Topology(
        ranks=cfg.stages,
        virtual_stages=cfg.virtual_stages,
        microbatches=cfg.microbatches,
        schedule=cfg.schedule,
        data_parallel=cfg.data_parallel,
        tensor_parallel=cfg.tensor_parallel,
    )
    validate_optimizer(cfg.optimizer, cfg.optimizer_args)
    if cfg.dispatch not in DISPATCH_MODES:
        raise InvalidInput(f"dispatch must be one of {', '.join(DISPATCH_MODES)}; got {cfg.dispatch!r}")
    if cfg.zero not in (0, 1):
        raise InvalidInput(f"zero must be 0 or 1 (ZeRO stage 1), got {cfg.zero}")
    if cfg.zero and cfg.data_parallel < 2:
        raise InvalidInput("zero=1 shards the optimizer state across data-parallel replicas: needs data_parallel > 1")
    if cfg.data_parallel > 1 and cfg.device != "cpu":
        raise InvalidInput("data parallelism runs on CPU workers only (not built for CUDA yet)")
    if cfg.tensor_parallel > 1 and cfg.device != "cpu":
        raise InvalidInput("tensor parallelism runs on CPU workers only (not built for CUDA yet)")
    if cfg.tensor_parallel_plan and cfg.tensor_parallel == 1:
        raise InvalidInput("tensor_parallel_plan names how to shard modules: it needs tensor_parallel > 1")
    if cfg.sequence_parallel and cfg.tensor_parallel == 1:
        raise InvalidInput(
            "sequence_parallel slices the sequence over a tensor-parallel island: needs tensor_parallel > 1"
        )
    if cfg.auto_resume and not cfg.checkpoint_path:
        raise InvalidInput("auto_resume restores from a checkpoint: it needs checkpoint_path")
    if cfg.auto_resume and cfg.zero:
        raise InvalidInput("auto_resume needs checkpoints, which ZeRO-1 jobs do not have yet")
    if cfg.checkpoint_every < 1:
        raise InvalidInput(f"checkpoint_every must be a positive number of steps, got {cfg.checkpoint_every}")
    if not cfg.weight > 0:
        raise InvalidInput(f"weight must be positive, got {cfg.weight}")
    if not cfg.data_plane_timeout_s > 0:
        raise InvalidInput(f"data_plane_timeout_s must be positive, got {cfg.data_plane_timeout_s}")
    if not req.model:
        raise InvalidInput("the program has no model")
    if cfg.device not in DEVICE_KINDS:
        raise InvalidInput(f"unknown device kind {cfg.device!r} (known: {', '.join(DEVICE_KINDS)})")
    if cfg.transport != "auto" and cfg.transport not in TRANSPORTS:
        raise InvalidInput(f"unknown transport {cfg.transport!r} (known: auto, {', '.join(TRANSPORTS)})")
    device = analysis_device(cfg.device)
    # every replica splits its 1/data_parallel of the batch into ``microbatches``
    mb_input = microbatch_spec(req.input, cfg.microbatches * cfg.data_parallel)
    mb_target = microbatch_spec(req.target, cfg.microbatches * cfg.data_parallel)
    split = split_model(req.model, mb_input, topo.num_stages, list(cfg.split_at), req.aliases)
    programs, shardings, loss_programs = [(st.program,) for st in split.stages], [None] * topo.num_stages, (req.loss,)
    flow = split.dataflow
    if topo.tensor_parallel > 1:
        shardings, loss_programs, flow = _shard(split, flow, cfg, mb_target, req.loss)
        programs = [s.programs for s in shardings]
    analyzed = [analyze_stage(s, p[0]) for s, p in enumerate(programs)]
    infos = [info for info, _ in analyzed]
    _check_edges(flow, infos)
    loss = analyze_loss(loss_programs[0], infos[-1].output, mb_target)
    routes = Routes(flow, topo.stage_ranks)

    def private(s: int) -> tuple[StageGraph, BlockGraph]:
        """Copies the CUDA analysis may move in place; on CPU the analyzed graphs themselves."""
        if device == "cpu":
            return StageGraph(analyzed[s][1]), loss
        fresh = BlockGraph(f"stage {s}", deserialize(infos[s].data, f"stage {s}"))
        return StageGraph(fresh), BlockGraph("loss", deserialize(loss_programs[0], "loss program"))

    stages = []
    for s in range(topo.num_stages):
        graph, stage_loss = private(s)
        is_last = s == topo.num_stages - 1
        memory = memory_plan.measure_stage(
            graph,
            infos[s].input,
            _from_stages(flow, s),
            stage_loss if is_last else None,
            mb_target if is_last else None,
            cfg.rematerialize,
            device,
        )
        stages.append(
            CompiledStage(
                index=s,
                rank=topo.rank_of(s),
                modules=split.stages[s].modules,
                info=infos[s],
                memory=memory,
                programs=programs[s],
                sharding=shardings[s],
            )
        )

    lowered = lower(build_schedule(topo), topo, routes)
    timeline = simulate(lowered.actions, topo, routes)
    if topo.tensor_parallel > 1:  # every island's ranks run their collectives in one order
        for r in range(topo.ranks):
            check_islands(
                {
                    t: island_order(
                        lowered.actions[r],
                        {s: sh.rank_collectives[t] for s, sh in enumerate(shardings)},
                        topo.num_stages - 1,
                    )
                    for t in range(topo.tensor_parallel)
                },
                f"pipeline rank {r}",
            )
    stage_params = {s: [p for _, p in StageGraph(analyzed[s][1]).named_parameters()] for s in range(topo.num_stages)}
    memory = memory_plan.predict(
        topo,
        lowered,
        {s.index: s.memory for s in stages},
        stage_params,
        cfg.optimizer,
        cfg.optimizer_args,
        routes,
        zero_shards=cfg.data_parallel if cfg.zero else 1,
    )
    island = communication_plan.island_bytes(shardings, cfg.rematerialize)
    communication = {
        r: communication_plan.predict_rank(
            lowered.actions[r],
            routes,
            r,
            [p for s in topo.stages_of(r) for p in stage_params[s]],
            cfg.data_parallel if cfg.zero else 1,
            island=island,
        )
        for r in range(topo.ranks)
    }
    return CompiledPipeline(
        request=req,
        topology=topo,
        dataflow=flow,
        routes=routes,
        batch_ranks=frozenset(topo.rank_of(e.dst) for e in flow.edges if e.src == BATCH),
        stages=stages,
        lowered=lowered,
        timeline=timeline,
        memory=memory,
        communication=communication,
        microbatch_input=mb_input,
        microbatch_target=mb_target,
        loss_programs=loss_programs,
    )


def _shard(split, flow: Dataflow, cfg: JobConfig, mb_target: EdgeSpec, loss: bytes):
    """Every stage sharded over its island (controller/compiler/parallel/tensor.py); a tied parameter must be
    cut alike by every stage holding it, and its gradient buffers are then its local piece."""
    T, last = cfg.tensor_parallel, len(split.stages) - 1
    shardings, loss_programs = [], (loss,)
    for st in split.stages:
        inputs = [t.empty("cpu").zero_() for t in _stage_input_spec(flow, st.index).tensors]
        sharded, losses = shard_stage(
            st.program,
            st.index,
            T,
            dict(cfg.tensor_parallel_plan),
            inputs,
            st.index == last,
            loss,
            mb_target,
            cfg.sequence_parallel,
        )
        shardings.append(sharded)
        if losses is not None:
            loss_programs = losses
    tied = []
    for t in flow.tied:
        cuts = {shardings[s].params.get(t.name) for s in t.stages}
        if len(cuts) > 1:
            raise InvalidInput(
                f"tied parameter {t.name} is cut differently by stages {list(t.stages)} ({cuts}); "
                "state a tensor_parallel_plan that keeps its modules alike"
            )
        (cut,) = cuts
        shape = list(t.spec.shape)
        if cut is not None:
            shape[cut.dim] //= T
        tied.append(TiedParameter(t.name, t.stages, TensorSpec(tuple(shape), t.spec.dtype)))
    return (
        shardings,
        (loss_programs if len(loss_programs) == T else loss_programs * T),
        Dataflow(flow.num_stages, flow.edges, tuple(tied)),
    )


def _stage_input_spec(flow: Dataflow, stage: int) -> EdgeSpec:
    """A stage's inputs by position, from the edges into it."""
    specs: dict[int, TensorSpec] = {}
    for _, e in flow.incoming(stage):
        for j, t in zip(e.dst_indices, e.spec.tensors):
            specs[j] = t
    return EdgeSpec(f"stage {stage} input", tuple(specs[j] for j in sorted(specs)))


def _from_stages(flow: Dataflow, stage: int) -> set[int]:
    """Input positions of ``stage`` that another stage produces (not the batch input)."""
    return {j for _, e in flow.incoming(stage) if e.src != BATCH for j in e.dst_indices}


def _check_edges(flow: Dataflow, infos: list[StageInfo]) -> None:
    """Every edge's tensors are what its producer outputs and its consumer takes at those positions."""
    for e in flow.edges:
        got_in = tuple(infos[e.dst].input.tensors[j] for j in e.dst_indices)
        got_out = e.spec.tensors if e.src == BATCH else tuple(infos[e.src].output.tensors[i] for i in e.src_indices)
        if not (got_in == got_out == e.spec.tensors):
            raise InvalidInput(f"edge {e.spec.name}: carries {e.spec}, but its ends have {got_out} and {got_in}")
