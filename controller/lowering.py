"""Lowering: compute-only schedules -> full per-rank action lists with SEND/RECV and STEP.

Receives are posted one compute ahead of the compute that consumes them, so a transfer overlaps
the rank's previous compute (gloo only moves the data once the receive is posted); sends are
posted right after the compute that produces them and completed before STEP. Each receive gets a
buffer slot, allocated once at load time and reused when the previous occupant's backward is done.
An edge between two stages on the same rank is a local hand-off: no SEND/RECV, no slot; the
executor passes the tensors from one stage to the next directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from atoll._actions import Action, Kind
from atoll.controller.schedules import Schedule
from atoll.controller.topology import Topology


@dataclass(frozen=True, slots=True)
class Lowered:
    actions: dict[int, list[Action]]
    """Per rank: the full action list of one step."""
    recv_slots: dict[int, dict[Action, int]]
    """Per rank: which receive buffer slot each RECV action fills."""
    slot_owner: dict[int, dict[int, tuple[int, Kind]]]
    """Per rank: slot -> (stage, RECV_F or RECV_B), i.e. which edge spec sizes the slot."""


def _recv_of(c: Action, topo: Topology, carries_grad: Callable[[int], bool]) -> Action | None:
    last = topo.num_stages - 1
    if c.kind is Kind.FORWARD and c.stage > 0 and not topo.is_local(c.stage - 1):
        return Action(c.stage, Kind.RECV_F, c.microbatch)
    if c.kind is Kind.BACKWARD and c.stage < last and carries_grad(c.stage) and not topo.is_local(c.stage):
        return Action(c.stage, Kind.RECV_B, c.microbatch)
    return None


def _sends_of(c: Action, topo: Topology, carries_grad: Callable[[int], bool]) -> list[Action]:
    last = topo.num_stages - 1
    if c.kind is Kind.FORWARD and c.stage < last and not topo.is_local(c.stage):
        return [Action(c.stage, Kind.SEND_F, c.microbatch)]
    if c.kind is Kind.BACKWARD and c.stage > 0 and carries_grad(c.stage - 1) and not topo.is_local(c.stage - 1):
        return [Action(c.stage, Kind.SEND_B, c.microbatch)]
    return []


def lower(schedule: Schedule, topo: Topology, carries_grad: Callable[[int], bool]) -> Lowered:
    """``carries_grad(e)``: whether edge e (stage e -> e+1) sends a gradient back."""
    actions: dict[int, list[Action]] = {}
    for rank, computes in schedule.items():
        recvs = [_recv_of(c, topo, carries_grad) for c in computes]
        out: list[Action] = []
        for i, c in enumerate(computes):
            ahead = [0, 1] if i == 0 else [i + 1]
            out.extend(recvs[j] for j in ahead if j < len(computes) and recvs[j] is not None)
            out.append(c)
            out.extend(_sends_of(c, topo, carries_grad))
        out.append(Action(topo.stages_of(rank)[0], Kind.STEP))
        actions[rank] = out
    recv_slots, slot_owner = {}, {}
    for rank, acts in actions.items():
        recv_slots[rank], slot_owner[rank] = _assign_slots(acts)
    return Lowered(actions, recv_slots, slot_owner)


def _assign_slots(actions: list[Action]) -> tuple[dict[Action, int], dict[int, tuple[int, Kind]]]:
    """Give each RECV the lowest free slot of its (stage, direction) pool; a slot frees up after
    the backward of its microbatch, since the received tensor is part of that autograd graph."""
    free: dict[tuple[int, Kind], list[int]] = {}
    held: dict[tuple[int, int], list[int]] = {}
    assignment: dict[Action, int] = {}
    owner: dict[int, tuple[int, Kind]] = {}
    for a in actions:
        if a.kind in (Kind.RECV_F, Kind.RECV_B):
            pool = free.setdefault((a.stage, a.kind), [])
            if pool:
                slot = pool.pop(0)
            else:
                slot = len(owner)
                owner[slot] = (a.stage, a.kind)
            assignment[a] = slot
            held.setdefault((a.stage, a.microbatch), []).append(slot)
        elif a.kind is Kind.BACKWARD:
            for slot in held.pop((a.stage, a.microbatch), []):
                free[owner[slot]].append(slot)
                free[owner[slot]].sort()
    return assignment, owner
