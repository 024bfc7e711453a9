"""A simulator of lowered action lists: finds deadlocks and ordering errors before any plan is
sent, and produces the predicted timeline (rank x time grid, bubble fraction).

Its rules are the executor's: a RECV posts a receive and never blocks; a compute waits until its
receive is posted and the peer's matching SEND has run; a SEND waits for the compute that
produces it; STEP waits until every send of the rank has a posted receive at its peer (gloo
completes a send only then). Times follow from those dependencies with per-action durations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from atoll._actions import Action, Kind
from atoll.controller.topology import Topology
from atoll.errors import InvalidInput


class ScheduleError(InvalidInput):
    """A lowered schedule that would deadlock or is malformed; the message names where."""


@dataclass(frozen=True, slots=True)
class Span:
    start: float
    end: float
    action: Action


@dataclass(frozen=True, slots=True)
class Timeline:
    spans: dict[int, list[Span]]
    makespan: float

    @property
    def bubble_fraction(self) -> float:
        busy = sum(s.end - s.start for spans in self.spans.values() for s in spans)
        total = self.makespan * len(self.spans)
        return 0.0 if total == 0 else 1.0 - busy / total

    def grid(self, unit: float = 1.0) -> list[list[str]]:
        """Rank x time cells of width ``unit``: an action's text, or '.' for a bubble."""
        columns = int(round(self.makespan / unit))
        rows = []
        for rank in sorted(self.spans):
            row = ["."] * columns
            for span in self.spans[rank]:
                for c in range(int(round(span.start / unit)), int(round(span.end / unit))):
                    row[c] = str(span.action)
            rows.append(row)
        return rows

    def render(self, unit: float = 1.0) -> str:
        rows = self.grid(unit)
        width = max((len(c) for row in rows for c in row), default=1)
        return "\n".join(f"rank {r}: " + " ".join(c.rjust(width) for c in row) for r, row in enumerate(rows))


def default_durations(action: Action) -> float:
    """Backward costs about twice the forward (it computes input and weight gradients)."""
    return {Kind.FORWARD: 1.0, Kind.BACKWARD: 2.0}.get(action.kind, 0.0)


def _peer_send(a: Action) -> Action:
    """The SEND whose data a compute consumes."""
    if a.kind is Kind.FORWARD:
        return Action(a.stage - 1, Kind.SEND_F, a.microbatch)
    return Action(a.stage + 1, Kind.SEND_B, a.microbatch)


def _local_producer(a: Action) -> Action:
    """The compute on the same rank whose result a compute takes over a local hand-off."""
    if a.kind is Kind.FORWARD:
        return Action(a.stage - 1, Kind.FORWARD, a.microbatch)
    return Action(a.stage + 1, Kind.BACKWARD, a.microbatch)


def _input_edge(a: Action) -> int:
    return a.stage - 1 if a.kind is Kind.FORWARD else a.stage


def _matching_recv(send: Action) -> Action:
    if send.kind is Kind.SEND_F:
        return Action(send.stage + 1, Kind.RECV_F, send.microbatch)
    return Action(send.stage - 1, Kind.RECV_B, send.microbatch)


def simulate(
    actions: dict[int, list[Action]],
    topo: Topology,
    durations: Callable[[Action], float] = default_durations,
    carries_grad: Callable[[int], bool] = lambda edge: True,
) -> Timeline:
    last = topo.num_stages - 1
    pos = {r: 0 for r in actions}
    clock = {r: 0.0 for r in actions}
    done: dict[Action, float] = {}  # compute and SEND actions -> time they finished
    posted: dict[Action, float] = {}  # RECV actions -> time posted
    consumed: set[Action] = set()
    spans: dict[int, list[Span]] = {r: [] for r in actions}

    def blocker(rank: int, a: Action) -> str | None:
        """Why ``a`` cannot run yet, or None when it can."""
        if a.kind is not Kind.STEP and topo.rank_of(a.stage) != rank:
            return f"stage {a.stage} does not live on rank {rank}"
        if a.kind in (Kind.RECV_F, Kind.RECV_B):
            return f"{a} is posted twice" if a in posted else None
        if a.kind in (Kind.FORWARD, Kind.BACKWARD):
            if a in done:
                return f"{a} runs twice"
            if a.kind is Kind.BACKWARD and Action(a.stage, Kind.FORWARD, a.microbatch) not in done:
                return f"waits for {a.stage}F{a.microbatch}, not yet run on this rank"
            needs_data = (a.stage > 0) if a.kind is Kind.FORWARD else (a.stage < last and carries_grad(a.stage))
            if needs_data and topo.is_local(_input_edge(a)):
                producer = _local_producer(a)
                return None if producer in done else f"waits for {producer}, not yet run on this rank"
            if needs_data:
                recv = Action(a.stage, Kind.RECV_F if a.kind is Kind.FORWARD else Kind.RECV_B, a.microbatch)
                if recv not in posted:
                    return f"its receive {recv} is not posted before it"
                send = _peer_send(a)
                if send not in done:
                    return f"waits for {send} on rank {topo.rank_of(send.stage)}"
            return None
        if a.kind in (Kind.SEND_F, Kind.SEND_B):
            if a in done:
                return f"{a} is sent twice"
            source = Action(a.stage, Kind.FORWARD if a.kind is Kind.SEND_F else Kind.BACKWARD, a.microbatch)
            return None if source in done else f"sends the result of {source}, which has not run"
        # STEP: every send of this rank must have been received by its peer
        for s in (x for x in actions[rank][: pos[rank]] if x.kind in (Kind.SEND_F, Kind.SEND_B)):
            if _matching_recv(s) not in posted:
                return f"its send {s} has no receive posted by rank {topo.rank_of(_matching_recv(s).stage)}"
        return None

    def run(rank: int, a: Action) -> None:
        start = clock[rank]
        if a.kind in (Kind.FORWARD, Kind.BACKWARD):
            needs_data = (a.stage > 0) if a.kind is Kind.FORWARD else (a.stage < last and carries_grad(a.stage))
            if needs_data and topo.is_local(_input_edge(a)):
                start = max(start, done[_local_producer(a)])
            elif needs_data:
                send = _peer_send(a)
                start = max(start, done[send])
                consumed.add(Action(a.stage, Kind.RECV_F if a.kind is Kind.FORWARD else Kind.RECV_B, a.microbatch))
            end = start + durations(a)
            spans[rank].append(Span(start, end, a))
            done[a] = end
        elif a.kind in (Kind.RECV_F, Kind.RECV_B):
            posted[a], end = start, start
        else:
            end = start + durations(a)
            if a.kind is not Kind.STEP:
                done[a] = end
        clock[rank] = end

    progress = True
    while progress:
        progress = False
        for rank, acts in actions.items():
            while pos[rank] < len(acts):
                a = acts[pos[rank]]
                if blocker(rank, a) is not None:
                    break
                run(rank, a)
                pos[rank] += 1
                progress = True

    stuck = {r: pos[r] for r in actions if pos[r] < len(actions[r])}
    if stuck:
        lines = [
            f"worker rank {r} blocks at action #{i} '{actions[r][i]}': {blocker(r, actions[r][i])}"
            for r, i in stuck.items()
        ]
        raise ScheduleError("schedule deadlocks:\n  " + "\n  ".join(lines))
    _check_complete(actions, topo, done, posted, consumed)
    return Timeline(spans, max(clock.values(), default=0.0))


def _check_complete(actions, topo, done, posted, consumed) -> None:
    problems = []
    for s in range(topo.num_stages):
        for m in range(topo.microbatches):
            for kind in (Kind.FORWARD, Kind.BACKWARD):
                if Action(s, kind, m) not in done:
                    problems.append(f"rank {topo.rank_of(s)} never runs {Action(s, kind, m)}")
    for recv in posted.keys() - consumed:
        problems.append(f"rank {topo.rank_of(recv.stage)} posts {recv} but nothing consumes it")
    if problems:
        raise ScheduleError("schedule is incomplete:\n  " + "\n  ".join(problems[:20]))
