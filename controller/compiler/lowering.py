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
rank first runs GATHER_PARAMS, its parameters gathered from the replicas' shards.
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


def lower(schedule: Schedule, topo: Topology, routes: Routes, gather: bool = False) -> Lowered:
    """``gather``: ZeRO-3, each rank's parameters are gathered at the start of every step."""
    actions: dict[int, list[Action]] = {}
    for rank, computes in schedule.items():
        recvs = [_recv_of(c, routes) for c in computes]
        out: list[Action] = [Action(topo.stages_of(rank)[0], Kind.GATHER_PARAMS)] if gather else []
        for i, c in enumerate(computes):
            ahead = [0, 1] if i == 0 else [i + 1]
            out.extend(recvs[j] for j in ahead if j < len(computes) and recvs[j] is not None)
            out.append(c)
            out.extend(_sends_of(c, routes))
        first = topo.stages_of(rank)[0]
        if routes.reduces_on(rank):
            out.append(Action(first, Kind.REDUCE_GRAD))
        if topo.data_parallel > 1:
            out.append(Action(first, Kind.ALL_REDUCE_GRAD))
        out.append(Action(first, Kind.STEP))
        actions[rank] = out
    recv_slots, slot_owner = {}, {}
    for rank, acts in actions.items():
        recv_slots[rank], slot_owner[rank] = _assign_slots(acts)
    return Lowered(actions, recv_slots, slot_owner)


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
