"""Predicted peak bytes per worker, before anything runs.

Per stage, the bytes one microbatch stashes come from running the stage on fake tensors of the
worker's device (see controller.program) with the executor's own accounting
(atoll.core.memory.SavedTensors); per rank, the lowered action
list is then walked with the executor's observation points (after each compute and STEP, and
mid-backward for a recomputed forward), so prediction and measurement count the same things.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from atoll.controller.compiler.lowering import Lowered
from atoll.controller.compiler.program import fake_inputs, fake_mode
from atoll.controller.compiler.topology import Topology
from atoll.core import split_backward
from atoll.core.dataflow import Routes
from atoll.core.graphs import BlockGraph, StageGraph, flatten, on_device
from atoll.core.memory import MemorySnapshot, SavedTensors, storage_key
from atoll.core.precision import as_specified, mixed_precision
from atoll.core.split_backward import held_bytes
from atoll.core.wire import EdgeSpec


@dataclass(frozen=True, slots=True)
class StageMemory:
    parameter_bytes: int
    """The parameters this job holds on the stage's worker: all of them, or, for a job attached
    to a resident base (JobConfig.base), its own (the frozen ones are the base's, counted there)."""
    stashed_bytes: int
    """Held from a microbatch's forward to its backward (just its input under rematerialization)."""
    recomputed_bytes: int
    """Held only during a backward that recomputes the forward (0 without rematerialization)."""
    held_bytes: int = 0
    """Where the backward is split: the gradients its input half keeps for its weight half
    (atoll.core.split_backward), held from I to W on top of the stash."""
    gradient_bytes: int = 0
    """The trainable parameters' bytes: a frozen parameter gets no gradient."""


def measure_stage(
    graph: StageGraph,
    input_spec: EdgeSpec,
    from_stages: set[int],
    loss: BlockGraph | None,
    target_spec: EdgeSpec | None,
    rematerialize: bool,
    device: str = "cpu",
    split_backward: bool = False,
    frozen_held_elsewhere: bool = False,
    autocast: bool = False,
    upcast: set[int] = frozenset(),
    output_spec: EdgeSpec | None = None,
) -> StageMemory:
    """Run one microbatch of a stage on fake tensors of ``device``, counting what the executor
    would hold. ``from_stages``: the input positions another stage produces (received into
    buffers or handed over from the producer's stash, so counted there); batch inputs are the
    stage's own. For a CUDA device ``graph`` and ``loss`` must be private copies: they are moved
    to fake device weights in place. With ``split_backward``, the input half of the backward runs
    too (on gradients standing for the received ones), counting what it keeps for the weight half.
    ``frozen_held_elsewhere``: the frozen parameters are a resident base's, not counted here.
    ``autocast``: mixed precision (JobConfig.precision "bf16"): the forward and the loss run under
    autocast to bfloat16 and the outputs are cast to ``output_spec``'s dtypes, as the worker runs
    them; the inputs at ``upcast`` arrive in bfloat16 and are upcast into tensors of their own, which
    count where autograd saves them."""
    with fake_mode() as mode:
        graph = graph.on(device, mode)
        if loss is not None and device != "cpu":
            loss = BlockGraph(loss.name, on_device(loss.ep, device, mode))
        params = [p for _, p in graph.named_parameters()]
        # Parameters take part as themselves or as their (memoized) fake copies: exclude both.
        # The copies are held until the end: a freed storage's key can be reused by an activation.
        fake_params = [mode.from_tensor(p) for p in params]
        exclude = {storage_key(p) for p in params + fake_params}
        inputs = fake_inputs(input_spec, device)
        for i in from_stages:
            if inputs[i].is_floating_point():
                inputs[i].requires_grad_()
            if i not in upcast:
                exclude.add(storage_key(inputs[i]))
        counter = SavedTensors(exclude)
        with counter, mixed_precision(autocast, device):
            out = graph.forward(inputs)
            outputs = flatten(out)
            if loss is not None:
                outputs = list(loss.call_flat(outputs + fake_inputs(target_spec, device)))
            elif autocast and output_spec is not None:
                outputs = as_specified(outputs, output_spec)
        counter.add(outputs)
        held = _held_bytes(outputs, loss is not None, inputs, graph, exclude) if split_backward else 0
    gradient_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    parameter_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad or not frozen_held_elsewhere)
    if not rematerialize:
        return StageMemory(parameter_bytes, counter.nbytes, 0, held, gradient_bytes)
    kept = SavedTensors(exclude)
    kept.add(inputs)
    return StageMemory(parameter_bytes, kept.nbytes, counter.nbytes, gradient_bytes=gradient_bytes)


def _held_bytes(outputs, is_loss: bool, inputs, graph: StageGraph, exclude: set[int]) -> int:
    """What the input half of a split backward keeps for the weight half, counted as the worker
    counts it (runtime/worker/executor/compute.py), on zeros standing for the output gradients."""
    if is_loss:  # the executor divides the loss by the microbatch count (any divisor keeps the same)
        roots, grads = [outputs[0] / 2], None
    else:
        roots = [o for o in outputs if o.requires_grad]
        grads = [torch.zeros_like(o) for o in roots]
    if not roots:
        return 0
    half = split_backward.backward_input(roots, grads, inputs, [p for _, p in graph.named_parameters()])
    return held_bytes(half, grads, exclude)


def optimizer_state_bytes(name: str, args: dict, params: Sequence[torch.Tensor]) -> int:
    """Bytes torch's optimizer allocates at its first step (momentum, Adam moments, step counters)."""
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    if name == "sgd":
        return param_bytes if args.get("momentum", 0) else 0
    moments = 3 if args.get("amsgrad", False) else 2
    step_counters = 4 * len(params)  # one float32 scalar tensor per parameter
    return moments * param_bytes + step_counters


@dataclass(frozen=True, slots=True)
class RankMemory:
    peak: MemorySnapshot
    peak_stashed_microbatches: int
    at_step: MemorySnapshot | None = None
    """At the optimizer step: the model state as the ZeRO paper counts it."""


class ZeroBytes(NamedTuple):
    """One ZeRO unit's layout in bytes: its stage, its flat buffer (padded to equal shards) and one shard."""

    stage: int
    flat: int
    shard: int


@dataclass(frozen=True, slots=True)
class ZeroLayout:
    """A job's ZeRO stage over its data-parallel replicas (runtime/worker/executor/zero.py)."""

    stage: int
    replicas: int
    per_stage: bool = False
    """ZeRO-3 with ``reshard_after_forward``: each stage's parameters are a unit of their own."""

    def bytes_of(self, params: Sequence[torch.Tensor]) -> ZeroBytes:
        shard = math.ceil(sum(p.numel() for p in params) / self.replicas)
        item = params[0].element_size() if params else 0
        return ZeroBytes(self.stage, shard * self.replicas * item, shard * item)

    def units(self, stages: Sequence[int], stage_params: dict[int, list[torch.Tensor]]) -> dict[int, list[int]]:
        """A rank's units: the first stage of each -> its stages (those without trainable
        parameters belong to none when each stage is a unit)."""
        if not self.per_stage:
            return {stages[0]: list(stages)}
        return {s: [s] for s in stages if stage_params[s]}

    def unit_params(self, stages: Sequence[int], stage_params: dict[int, list[torch.Tensor]]) -> dict[int, list]:
        """Stage -> the parameters of its unit (what its replica collectives move)."""
        return {
            s: [p for t in members for p in stage_params[t]]
            for members in self.units(stages, stage_params).values()
            for s in members
        }


@dataclass(frozen=True, slots=True)
class ZeroUnits:
    """A rank's ZeRO units, as the memory walk needs them."""

    bytes: dict[int, ZeroBytes]
    """Unit (its first stage) -> its layout."""
    unit_of: dict[int, int]
    """Stage -> its unit."""


def predict_rank(
    actions,
    stage_memory: dict[int, StageMemory],
    optimizer_bytes: int,
    buffer_bytes: int,
    zero: ZeroUnits | None = None,
) -> RankMemory:
    """``zero``: the ZeRO layout of the rank's trainable parameters, if any."""
    trainable = sum(stage_memory[s].gradient_bytes for s in stage_memory)
    parameters = sum(stage_memory[s].parameter_bytes for s in stage_memory)
    if zero is not None:  # laid out in flat buffers (ZeRO-3: only this replica's shard of each)
        parameters += sum(u.shard if u.stage == 3 else u.flat for u in zero.bytes.values()) - trainable
    unit_of = zero.unit_of if zero is not None else {}
    activations, stashed, peak, peak_stashed, at_step = 0, 0, MemorySnapshot(), 0, None
    stages_with_grads: set[int] = set()
    reduced: dict[int, int] = {}  # unit -> its gradient bytes once the replicas' reduction has run
    gathered: set[int] = set()  # ZeRO-3: the units whose whole parameters are held
    in_flight: set[int] = set()  # ZeRO-2/3: the unit whose reduce-scatter runs, its packed buffer held

    def land():  # the reduce-scatter in flight is waited for: its packed buffer is freed
        for u in in_flight:
            reduced[u] = zero.bytes[u].shard
        in_flight.clear()

    def observe(step: bool = False):
        nonlocal peak, peak_stashed, at_step
        grads = sum(stage_memory[s].gradient_bytes for s in stages_with_grads if unit_of.get(s) not in reduced)
        snap = MemorySnapshot(
            parameters=parameters,
            gradients=grads + sum(reduced.values()),
            optimizer=optimizer_bytes,
            activations=activations,
            buffers=buffer_bytes,
        )
        if step:
            at_step = snap
        if snap.total > peak.total:
            peak = snap
        peak_stashed = max(peak_stashed, stashed)

    held: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> bytes its input half keeps
    for a in actions:
        unit = unit_of.get(a.stage)
        if a.kind.memory == "stash":
            activations += stage_memory[a.stage].stashed_bytes
            stashed += 1
            observe()
        elif a.kind.memory == "hold":
            held[(a.stage, a.microbatch)] = stage_memory[a.stage].held_bytes
            activations += stage_memory[a.stage].held_bytes
            observe()
        elif a.kind.memory == "release":
            mem = stage_memory[a.stage]
            if mem.recomputed_bytes:
                activations += mem.recomputed_bytes
                observe()
                activations -= mem.recomputed_bytes
            activations -= mem.stashed_bytes + held.pop((a.stage, a.microbatch), 0)
            stashed -= 1
            stages_with_grads.add(a.stage)
            observe()
        elif a.kind.memory == "gather" and unit is not None:
            if unit not in gathered:
                parameters += zero.bytes[unit].flat
                gathered.add(unit)
            observe()  # as the worker does after every gather
        elif a.kind.memory == "free" and unit in gathered:
            parameters -= zero.bytes[unit].flat
            gathered.discard(unit)
        elif a.kind.memory == "reduce" and unit is not None:
            land()  # one in flight at a time (runtime/worker/executor/zero.py)
            layout = zero.bytes[unit]
            if layout.stage == 1:  # an all-reduce, waited for: each replica keeps the whole average
                reduced[unit] = layout.flat
            else:  # its shard, and the packed gradients until the reduce-scatter lands
                reduced[unit] = layout.shard + layout.flat
                in_flight.add(unit)
        elif a.kind.memory == "observe":
            if a.kind.category == "step":  # the step waits for the reductions first
                land()
            observe(step=a.kind.category == "step")
    return RankMemory(peak, peak_stashed, at_step)


def buffer_bytes(lowered: Lowered, rank: int, routes: Routes) -> int:
    """Receive slots (sized by what their RECV fills) and REDUCE_GRAD's receive buffers."""
    total = 0
    for stage, kind in lowered.slot_owner[rank].values():
        specs = routes.recv_f_specs(stage) if kind.direction == "forward" else routes.recv_b_specs(stage)
        total += sum(t.nbytes for t in specs)
    return total + sum(t.nbytes for t in routes.tied_recv_specs(rank))


def predict(
    topo: Topology,
    lowered: Lowered,
    stage_memory: dict[int, StageMemory],
    stage_params: dict[int, list[torch.Tensor]],
    optimizer: str,
    optimizer_args: dict,
    routes: Routes,
    zero: ZeroLayout | None = None,
) -> dict[int, RankMemory]:
    """Per rank. Under ZeRO a rank's trainable parameters are flat buffers (one per unit), each
    padded to equal shards, and its optimizer steps one shard of each (runtime/worker/executor/zero.py):
    one tensor of ceil(elements / replicas) per unit."""
    out = {}
    for rank in range(topo.ranks):
        stages = topo.stages_of(rank)
        params = [p for s in stages for p in stage_params[s]]
        units = None
        if zero is not None and params:
            members = zero.units(stages, stage_params)
            layouts = {u: zero.bytes_of([p for s in ss for p in stage_params[s]]) for u, ss in members.items()}
            units = ZeroUnits(layouts, {s: u for u, ss in members.items() for s in ss})
            item = params[0].element_size()
            params = [torch.empty(b.shard // item, dtype=params[0].dtype, device="meta") for b in layouts.values()]
        out[rank] = predict_rank(
            lowered.actions[rank],
            {s: stage_memory[s] for s in stages},
            optimizer_state_bytes(optimizer, optimizer_args, params),
            buffer_bytes(lowered, rank, routes),
            units,
        )
    return out
