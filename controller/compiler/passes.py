"""The compiler's passes, in the order ``PASSES`` runs them over one ``CompileState``. Each reads
what earlier passes added and adds its own fields; none returns anything or reads the request
after ``microbatch`` has read it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from atoll.controller.compiler import autoschedule
from atoll.controller.compiler import communication as communication_plan
from atoll.controller.compiler import memory as memory_plan
from atoll.controller.compiler.checks import check_config
from atoll.controller.compiler.compile_cache import COMPILED
from atoll.controller.compiler.lowering import Lowered, lower
from atoll.controller.compiler.parallel.tensor import ShardedStage
from atoll.controller.compiler.program import StageInfo, analyze_loss, analyze_stage
from atoll.controller.compiler.schedules import build_schedule
from atoll.controller.compiler.sharding import shard_stages
from atoll.controller.compiler.simulate import Timeline, check_islands, island_order, simulate
from atoll.controller.compiler.split import SplitModel, split_model
from atoll.controller.compiler.topology import Topology
from atoll.core.config import JobConfig
from atoll.core.dataflow import BATCH, Dataflow, Routes
from atoll.core.graphs import BlockGraph, StageGraph, deserialize
from atoll.core.names import SPLIT_BACKWARD_SCHEDULES
from atoll.core.wire import EdgeSpec, TensorSpec
from atoll.errors import InvalidInput


@dataclass(slots=True)
class CompileState:
    """Everything the passes know of one job, filled in pass by pass."""

    request: object  # PipelineRequest (controller/compiler/pipeline.py)
    config: JobConfig
    topology: Topology | None = None
    device: str = "cpu"
    """Where the fake-tensor analysis runs (``analysis_device``)."""
    microbatch_input: EdgeSpec | None = None
    microbatch_target: EdgeSpec | None = None
    split: SplitModel | None = None
    dataflow: Dataflow | None = None
    programs: list[tuple[bytes, ...]] = field(default_factory=list)
    """Per stage, per island rank: its exported program."""
    shardings: list[ShardedStage | None] = field(default_factory=list)
    loss_programs: tuple[bytes, ...] = ()
    analyzed: list = field(default_factory=list)
    """Per stage: (StageInfo, its analyzed graph)."""
    loss: BlockGraph | None = None
    routes: Routes | None = None
    batch_ranks: frozenset[int] = frozenset()
    """Ranks running a stage that reads the batch input."""
    stages: list = field(default_factory=list)
    """Per stage: its CompiledStage."""
    lowered: Lowered | None = None
    timeline: Timeline | None = None
    memory: dict[int, memory_plan.RankMemory] = field(default_factory=dict)
    communication: dict[int, dict[str, int]] = field(default_factory=dict)

    stage_params: dict[int, list] = field(default_factory=dict)
    """Per stage: its parameters (fake tensors), read by the memory and communication predictions."""
    schedule_choice: autoschedule.Choice | None = None
    """With schedule="auto": what was chosen, among which candidates, and why."""

    @property
    def infos(self) -> list[StageInfo]:
        return [info for info, _ in self.analyzed]


def analysis_device(device: str) -> str:
    """The device whose kernels the fake-tensor analysis runs: the job's, when this process has it.
    Fake CUDA tensors need a CUDA build of torch (no GPU memory is used); a controller without one
    analyzes a CUDA job with CPU kernels, and the plan says so (memory may then differ a little,
    e.g. where attention takes another fused kernel)."""
    if device == "cuda" and not torch.cuda.is_available():
        return "cpu"
    return device


def microbatch_spec(full: EdgeSpec, microbatches: int) -> EdgeSpec:
    tensors = []
    for t in full.tensors:
        if not t.shape or t.shape[0] % microbatches:
            raise InvalidInput(
                f"edge '{full.name}': batch dimension of {t} is not divisible into {microbatches} microbatches"
            )
        tensors.append(TensorSpec((t.shape[0] // microbatches, *t.shape[1:]), t.dtype))
    return EdgeSpec(full.name, tuple(tensors))


def validate(st: CompileState) -> None:
    """Reads the config; adds the topology (which checks the layout and schedule) and the analysis
    device, or refuses the job with the setting that cannot run."""
    cfg = st.config
    check_config(cfg)
    same = ("virtual_stages", "microbatches", "data_parallel", "tensor_parallel")
    # "auto" is placed as its first candidate until choose_schedule has simulated them all
    first = cfg.auto_candidates()[0] if cfg.schedule == "auto" else cfg.schedule
    st.topology = Topology(ranks=cfg.stages, schedule=first, **{name: getattr(cfg, name) for name in same})
    if not st.request.model:
        raise InvalidInput("the program has no model")
    st.device = analysis_device(cfg.device)


def microbatch(st: CompileState) -> None:
    """Reads the full-batch specs; adds the microbatch specs: every replica splits its
    1/data_parallel of the batch into ``microbatches``."""
    pieces = st.config.microbatches * st.config.data_parallel
    st.microbatch_input = microbatch_spec(st.request.input, pieces)
    st.microbatch_target = microbatch_spec(st.request.target, pieces)


def split(st: CompileState) -> None:
    """Reads the exported model; adds its stages (at submodule boundaries, balanced by cost) and
    the dataflow graph between them (controller/compiler/split.py), or the same model's last split
    the same way (controller/compiler/compile_cache.py)."""
    req, topo = st.request, st.topology
    split_at, aliases = list(st.config.split_at), req.aliases
    st.split = COMPILED.get(
        "split",
        (req.model,),
        (st.microbatch_input, topo.num_stages, tuple(split_at), tuple(sorted(aliases.items()))),
        lambda: split_model(req.model, st.microbatch_input, topo.num_stages, split_at, aliases),
        lambda split: sum(len(s.program) for s in split.stages),
    )
    st.dataflow = st.split.dataflow
    st.programs = [(s.program,) for s in st.split.stages]
    st.shardings = [None] * topo.num_stages
    st.loss_programs = (req.loss,)


def shard(st: CompileState) -> None:
    """With tensor parallelism: replaces each stage's program by one per island rank, the loss by
    its vocabulary-parallel form where the logits stay sharded, and the tied parameters' specs by
    their local pieces (controller/compiler/sharding.py)."""
    if st.topology.tensor_parallel == 1:
        return
    st.shardings, st.loss_programs, st.dataflow = shard_stages(
        st.split, st.dataflow, st.config, st.microbatch_target, st.request.loss
    )
    st.programs = [s.programs for s in st.shardings]


def analyze(st: CompileState) -> None:
    """Reads each stage's program; adds its specs and cost (on fake tensors), checks every edge
    against both its ends, analyzes the loss, and places the dataflow on the ranks (routes)."""
    st.analyzed = [analyze_stage(s, p[0]) for s, p in enumerate(st.programs)]
    # the optimizer's parameters: a frozen one (a resident base's, say) gets no gradient and no state
    st.stage_params = {
        s: [p for _, p in StageGraph(g).named_parameters() if p.requires_grad] for s, (_, g) in enumerate(st.analyzed)
    }
    infos = st.infos
    _check_edges(st.dataflow, infos)
    if st.config.precision == "bf16":  # the edges carry bfloat16; each stage computes in its own dtypes
        st.dataflow = st.dataflow.carried_in("bfloat16")
    st.loss = analyze_loss(st.loss_programs[0], infos[-1].output, st.microbatch_target)
    st.routes = Routes(st.dataflow, st.topology.stage_ranks)
    st.batch_ranks = frozenset(st.topology.rank_of(e.dst) for e in st.dataflow.edges if e.src == BATCH)


def choose_schedule(st: CompileState) -> None:
    """With schedule="auto": simulates every candidate at the job's costs and keeps the fastest
    (controller/compiler/autoschedule.py), placing the dataflow as that schedule places it; adds
    the choice, with every candidate's prediction, for the report."""
    if st.config.schedule != "auto":
        return
    flops = [info.forward_flops for info in st.infos]
    st.topology, st.schedule_choice = autoschedule.choose(st.topology, st.config, st.dataflow, flops)
    st.routes = Routes(st.dataflow, st.topology.stage_ranks)
    st.batch_ranks = frozenset(st.topology.rank_of(e.dst) for e in st.dataflow.edges if e.src == BATCH)


def measure_stages(st: CompileState) -> None:
    """Adds each stage's memory (parameters, activations stashed per microbatch, recomputed ones)
    and its CompiledStage."""
    from atoll.controller.compiler.pipeline import CompiledStage

    topo, infos = st.topology, st.infos
    st.stages = []
    for s in range(topo.num_stages):
        graph, stage_loss = _private(st, s)
        is_last = s == topo.num_stages - 1
        memory = memory_plan.measure_stage(
            graph,
            infos[s].input,
            _from_stages(st.dataflow, s),
            stage_loss if is_last else None,
            st.microbatch_target if is_last else None,
            st.config.rematerialize,
            st.device,
            split_backward=topo.schedule in SPLIT_BACKWARD_SCHEDULES,
            frozen_held_elsewhere=bool(st.config.base),
            autocast=st.config.precision == "bf16",
            upcast=_upcast(st, s),
            output_spec=infos[s].output,
        )
        st.stages.append(
            CompiledStage(
                index=s,
                rank=topo.rank_of(s),
                modules=st.split.stages[s].modules,
                start=st.split.stages[s].start,
                info=infos[s],
                memory=memory,
                programs=st.programs[s],
                sharding=st.shardings[s],
            )
        )


def schedule(st: CompileState) -> None:
    """Reads the topology and routes; adds the lowered per-rank action lists (the schedule as data,
    lowered per edge: SEND/RECV or local hand-off, receive slots, per-step collectives)."""
    cfg = st.config
    gather, reshard = cfg.zero == 3, cfg.zero == 3 and cfg.reshard_after_forward
    st.lowered = lower(build_schedule(st.topology), st.topology, st.routes, gather=gather, reshard=reshard)


def simulate_plan(st: CompileState) -> None:
    """Reads the action lists; adds the predicted timeline, refusing a plan that deadlocks, and
    checks that every island's ranks run their collectives in one order."""
    topo = st.topology
    st.timeline = simulate(st.lowered.actions, topo, st.routes)
    if topo.tensor_parallel == 1:
        return
    for r in range(topo.ranks):
        collectives = {s: sh.rank_collectives for s, sh in enumerate(st.shardings)}
        orders = {
            t: island_order(st.lowered.actions[r], {s: c[t] for s, c in collectives.items()}, topo.num_stages - 1)
            for t in range(topo.tensor_parallel)
        }
        check_islands(orders, f"pipeline rank {r}")


def predict_memory(st: CompileState) -> None:
    """Adds each rank's predicted peak memory (controller/compiler/memory.py)."""
    cfg, topo = st.config, st.topology
    st.memory = memory_plan.predict(
        topo,
        st.lowered,
        {s.index: s.memory for s in st.stages},
        st.stage_params,
        cfg.optimizer,
        cfg.optimizer_args,
        st.routes,
        zero=_zero_layout(cfg),
    )


def _zero_layout(cfg) -> memory_plan.ZeroLayout | None:
    return memory_plan.ZeroLayout(cfg.zero, cfg.data_parallel, cfg.reshard_after_forward) if cfg.zero else None


def count_communication(st: CompileState) -> None:
    """Adds the bytes each rank moves in one step (controller/compiler/communication.py)."""
    cfg, topo = st.config, st.topology
    island = communication_plan.island_bytes(st.shardings, cfg.rematerialize)
    zero = _zero_layout(cfg)  # under ZeRO each replica collective moves its stage's unit
    units = {r: zero.unit_params(topo.stages_of(r), st.stage_params) for r in range(topo.ranks)} if zero else {}
    st.communication = {
        r: communication_plan.predict_rank(
            st.lowered.actions[r],
            st.routes,
            r,
            [p for s in topo.stages_of(r) for p in st.stage_params[s]],
            cfg.data_parallel if cfg.zero else 1,
            island=island,
            unit_params=units.get(r),
        )
        for r in range(topo.ranks)
    }


PASSES = (
    validate,
    microbatch,
    split,
    shard,
    analyze,
    choose_schedule,
    measure_stages,
    schedule,
    simulate_plan,
    predict_memory,
    count_communication,
)
"""The compiler, in order. Placement on workers comes after (controller/cluster/placement.py),
and picks each edge's transport (controller/cluster/transports.py)."""


def _private(st: CompileState, s: int) -> tuple[StageGraph, BlockGraph]:
    """Copies the CUDA analysis may move in place; on CPU the analyzed graphs themselves."""
    if st.device == "cpu":
        return StageGraph(st.analyzed[s][1]), st.loss
    fresh = BlockGraph(f"stage {s}", deserialize(st.infos[s].data, f"stage {s}"))
    return StageGraph(fresh), BlockGraph("loss", deserialize(st.loss_programs[0], "loss program"))


def _upcast(st: CompileState, stage: int) -> set[int]:
    """Input positions of ``stage`` that arrive from another rank in another dtype than the stage
    computes in (bfloat16 on the wire): the worker upcasts each into a tensor of its own."""
    rank = st.topology.rank_of(stage)
    own = st.infos[stage].input.tensors
    return {
        j
        for _, e in st.dataflow.incoming(stage)
        if e.src != BATCH and st.topology.rank_of(e.src) != rank
        for t, j in zip(e.spec.tensors, e.dst_indices)
        if t.dtype != own[j].dtype
    }


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
