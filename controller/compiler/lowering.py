"""Lowering: compute-only schedules -> full per-rank action lists with SEND/RECV and STEP.

Lowering works per edge of the dataflow graph (atoll.core.dataflow.Routes): a stage's RECV_F receives
every remote edge into it (possibly from several producers: a skip edge arrives straight from its
producer), its SEND_F sends every remote edge out of it, and RECV_B/SEND_B do the same for
gradients. An edge between two stages on one rank is a local hand-off: no SEND/RECV, no slot; the
executor passes the tensors in memory.

Receives are posted one compute ahead of the compute that consumes them, so a transfer overlaps
the rank's previous compute (gloo only moves the data once the receive is posted); sends are
posted right after the compute that produces them and completed before STEP. Each receive gets a
buffer slot, allocated once at load time and reused when the previous occupant's backward is done.
A rank holding a tied parameter runs REDUCE_GRAD just before STEP; with data-parallel replicas,
every rank then runs ALL_REDUCE_GRAD (the replicas' identical lists meet there). Under ZeRO-3 every
rank first runs GATHER_PARAMS, its parameters gathered from the replicas' shards, and RELEASE_PARAMS
after the reduction; with ``reshard_after_forward``, per stage and per compute (``_unit_actions``).
"""

from __future__ import annotations

from dataclasses import dataclass

from atoll.controller.compiler.schedules import Schedule
from atoll.controller.compiler.topology import Topology
from atoll.core.actions import Action, ActionSpec, Kind, paired
from atoll.core.dataflow import Routes


@dataclass(frozen=True, slots=True)
class Lowered:
    actions: dict[int, list[Action]]
    """Per rank: the full action list of one step."""
    recv_slots: dict[int, dict[Action, int]]
    """Per rank: which receive buffer slot each RECV action fills."""
    slot_owner: dict[int, dict[int, tuple[int, ActionSpec]]]
    """Per rank: slot -> (stage, RECV_F or RECV_B), i.e. which edge spec sizes the slot."""


def _recv_of(c: Action, routes: Routes) -> Action | None:
    if c.kind.direction is None:  # a weight gradient receives nothing
        return None
    forward = c.kind.direction == "forward"
    if routes.needs_recv_f(c.stage) if forward else routes.needs_recv_b(c.stage):
        return Action(c.stage, paired(c.kind, "recv"), c.microbatch)
    return None


def _sends_of(c: Action, routes: Routes) -> list[Action]:
    if c.kind.direction is None:  # ... and sends nothing
        return []
    forward = c.kind.direction == "forward"
    if routes.sends_f(c.stage) if forward else routes.sends_b(c.stage):
        return [Action(c.stage, paired(c.kind, "send"), c.microbatch)]
    return []


def lower(schedule: Schedule, topo: Topology, routes: Routes, gather: bool = False, reshard: bool = False) -> Lowered:
    """``gather``: ZeRO-3, each rank's parameters are gathered at the start of every step and
    released after the replicas' reduction. ``reshard``: ZeRO-3 with ``reshard_after_forward``,
    per stage (``_unit_actions``)."""
    actions: dict[int, list[Action]] = {}
    for rank, computes in schedule.items():
        recvs = [_recv_of(c, routes) for c in computes]
        first = topo.stages_of(rank)[0]
        # a tied parameter's copies are summed before any replica reduction (REDUCE_GRAD, at the end)
        units = _unit_actions(computes, reduce_early=not routes.reduces_on(rank)) if reshard else None
        out: list[Action] = [Action(first, Kind.GATHER_PARAMS)] if gather and not reshard else []
        for i, c in enumerate(computes):
            ahead = [0, 1] if i == 0 else [i + 1]
            out.extend(recvs[j] for j in ahead if j < len(computes) and recvs[j] is not None)
            out.extend(units.before[i] if units else ())
            out.append(c)
            out.extend(_sends_of(c, routes))
            out.extend(units.after[i] if units else ())
        if routes.reduces_on(rank):
            out.append(Action(first, Kind.REDUCE_GRAD))
        if units is not None:
            out.extend(units.at_end)
        elif topo.data_parallel > 1:
            out.append(Action(first, Kind.ALL_REDUCE_GRAD))
        if gather and not reshard:
            out.append(Action(first, Kind.RELEASE_PARAMS))
        out.append(Action(first, Kind.STEP))
        actions[rank] = out
    recv_slots, slot_owner = {}, {}
    for rank, acts in actions.items():
        recv_slots[rank], slot_owner[rank] = _assign_slots(acts)
    return Lowered(actions, recv_slots, slot_owner)


@dataclass(frozen=True, slots=True)
class _UnitActions:
    before: list[list[Action]]
    after: list[list[Action]]
    at_end: list[Action]


def _unit_actions(computes: list[Action], reduce_early: bool) -> _UnitActions:
    """ZeRO-3 with ``reshard_after_forward``, each stage a unit (runtime/worker/executor/zero.py):
    before each compute, the gather of its stage's parameters if they are not held, and the gather
    of the next compute's stage, which then overlaps this compute (FSDP2's prefetch); after it, the
    stage's gradient reduce-scatter if it was the stage's last backward (``reduce_early``; else all
    at the end), and the release of its parameters unless the next compute is on the same stage."""
    n = len(computes)
    held: set[int] = set()
    before: list[list[Action]] = [[] for _ in range(n)]
    after: list[list[Action]] = [[] for _ in range(n)]
    last_backward = {c.stage: i for i, c in enumerate(computes) if c.kind.grads}
    for i, c in enumerate(computes):
        for s in [c.stage] + ([computes[i + 1].stage] if i + 1 < n else []):
            if s not in held:
                before[i].append(Action(s, Kind.GATHER_PARAMS))
                held.add(s)
        if reduce_early and last_backward.get(c.stage) == i:
            after[i].append(Action(c.stage, Kind.ALL_REDUCE_GRAD))
        if i + 1 == n or computes[i + 1].stage != c.stage:
            after[i].append(Action(c.stage, Kind.RELEASE_PARAMS))
            held.discard(c.stage)
    at_end = [] if reduce_early else [Action(s, Kind.ALL_REDUCE_GRAD) for s in sorted(last_backward)]
    return _UnitActions(before, after, at_end)


def _assign_slots(actions: list[Action]) -> tuple[dict[Action, int], dict[int, tuple[int, ActionSpec]]]:
    """Give each RECV the lowest free slot of its (stage, direction) pool; a slot frees up after
    the backward of its microbatch, since the received tensor is part of that autograd graph."""
    free: dict[tuple[int, ActionSpec], list[int]] = {}
    held: dict[tuple[int, int], list[int]] = {}
    assignment: dict[Action, int] = {}
    owner: dict[int, tuple[int, ActionSpec]] = {}
    for a in actions:
        if a.kind.category == "recv":
            pool = free.setdefault((a.stage, a.kind), [])
            if pool:
                slot = pool.pop(0)
            else:
                slot = len(owner)
                owner[slot] = (a.stage, a.kind)
            assignment[a] = slot
            held.setdefault((a.stage, a.microbatch), []).append(slot)
        elif a.kind.memory == "release":  # the backward (or W) that frees its microbatch's receives
            for slot in held.pop((a.stage, a.microbatch), []):
                free[owner[slot]].append(slot)
                free[owner[slot]].sort()
    return assignment, owner
