"""A simulator of lowered action lists: finds deadlocks and ordering errors before any plan is
sent, and produces the predicted timeline (rank x time grid, bubble fraction).

Its rules are the executor's, per edge of the dataflow graph: a RECV posts a receive and never
blocks; a compute waits until its receive is posted and every producer's (or, backward, every
consumer's) matching SEND has run, and for local hand-offs until the producing compute ran on
this rank; a SEND waits for the compute that produces it; REDUCE_GRAD waits for every rank holding
the same tied parameters; STEP waits until every send of the rank has a posted receive at its
peers (gloo completes a send only then). Times follow with per-action durations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from atoll.controller.compiler.topology import Topology
from atoll.core.actions import Action, Kind, kind_of, kinds, paired
from atoll.core.dataflow import Routes
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
    """Each kind's declared cost (atoll.core.actions)."""
    return action.kind.cost


def _recv_of(a: Action) -> Action:
    return Action(a.stage, paired(a.kind, "recv"), a.microbatch)


def _inputs(a: Action, routes: Routes, backward_kind: dict | None = None) -> tuple[list[Action], list[Action]]:
    """What compute ``a`` consumes: (computes on this rank it takes over a local hand-off,
    peers' SENDs whose data it receives). Forward data flows along the edges, gradients against them.
    ``backward_kind``: (stage, microbatch) -> the kind of its backward (B, or I where that one is
    split: a schedule may split some and not others), where not ``a``'s own."""
    if a.kind.direction is None:  # a weight gradient: only its own stage's input gradient
        return [], []
    s, m, send = a.stage, a.microbatch, paired(a.kind, "send")
    if a.kind.direction == "forward":
        local = [Action(e.src, a.kind, m) for _, e in routes.local_in(s)]
        remote = [Action(e.src, send, m) for _, e in routes.remote_in(s)]
    else:
        kind = lambda stage: (backward_kind or {}).get((stage, m), a.kind)  # noqa: E731
        local = [Action(e.dst, kind(e.dst), m) for _, e in routes.local_out(s) if e.differentiable]
        remote = [Action(e.dst, send, m) for _, e in routes.remote_out(s) if e.differentiable]
    return list(dict.fromkeys(local)), list(dict.fromkeys(remote))


def matching_recvs(send: Action, routes: Routes) -> list[Action]:
    s, m, recv = send.stage, send.microbatch, paired(send.kind, "recv")
    if send.kind.direction == "forward":
        return list(dict.fromkeys(Action(e.dst, recv, m) for _, e in routes.remote_out(s)))
    return list(dict.fromkeys(Action(e.src, recv, m) for _, e in routes.remote_in(s) if e.differentiable))


def _computes(direction: str | None) -> list:
    """The compute kinds of a direction (a backward: B, or I of a split one)."""
    return [k for k in kinds() if k.category == "compute" and k.direction == direction]


def _meets_tied(a: Action) -> bool:
    return a.kind.group == "tied"


def simulate(
    actions: dict[int, list[Action]],
    topo: Topology,
    routes: Routes,
    durations: Callable[[Action], float] = default_durations,
) -> Timeline:
    pos = {r: 0 for r in actions}
    clock = {r: 0.0 for r in actions}
    done: dict[Action, float] = {}  # compute and SEND actions -> time they finished
    posted: dict[Action, float] = {}  # RECV actions -> time posted
    consumed: set[Action] = set()
    spans: dict[int, list[Span]] = {r: [] for r in actions}
    reduce_at = {r: next((i for i, a in enumerate(acts) if _meets_tied(a)), None) for r, acts in actions.items()}
    reduced: dict[int, float] = {}  # rank -> time its REDUCE_GRAD finished
    used = {a.kind for acts in actions.values() for a in acts}  # the schedule's kinds, for messages
    backward_kind = {
        (a.stage, a.microbatch): a.kind
        for acts in actions.values()
        for a in acts
        if a.kind.category == "compute" and a.kind.direction == "backward"
    }

    def blocker(rank: int, a: Action) -> str | None:
        """Why ``a`` cannot run yet, or None when it can."""
        category = a.kind.category
        if not a.kind.per_step and topo.rank_of(a.stage) != rank:
            return f"stage {a.stage} does not live on rank {rank}"
        if category == "local":
            return None
        if category == "recv":
            return f"{a} is posted twice" if a in posted else None
        if category == "compute":
            if a in done:
                return f"{a} runs twice"
            needed = Action(a.stage, kind_of(a.kind.requires), a.microbatch) if a.kind.requires else None
            if needed is not None and needed not in done:
                return f"waits for {needed}, not yet run on this rank"
            local, remote = _inputs(a, routes, backward_kind)
            for producer in local:
                if producer not in done:
                    return f"waits for {producer}, not yet run on this rank"
            if remote:
                recv = _recv_of(a)
                if recv not in posted:
                    return f"its receive {recv} is not posted before it"
                for send in remote:
                    if send not in done:
                        return f"waits for {send} on rank {topo.rank_of(send.stage)}"
            return None
        if category == "send":
            if a in done:
                return f"{a} is sent twice"
            # the compute whose result it sends: B, or I where the backward is split
            sources = [Action(a.stage, k, a.microbatch) for k in _computes(a.kind.direction) if k in used]
            if any(x in done for x in sources):
                return None
            return f"sends the result of {' or '.join(map(str, sources))}, which has not run"
        if _meets_tied(a):  # a collective of the ranks holding tied parameters
            for peer in sorted(routes.tied_peers(rank)):
                if reduce_at.get(peer) is None:
                    return f"rank {peer} holds a tied parameter but runs no {a.kind.code}"
                if pos[peer] < reduce_at[peer]:
                    return f"waits for rank {peer} to reach its {a.kind.code}"
            return None
        if category == "collective":  # with the same rank of every replica, whose lists are this one
            return None
        # the step: every send of this rank must have been received by its peer
        for s in (x for x in actions[rank][: pos[rank]] if x.kind.category == "send"):
            for recv in matching_recvs(s, routes):
                if recv not in posted:
                    return f"its send {s} has no receive posted by rank {topo.rank_of(recv.stage)}"
        return None

    def run(rank: int, a: Action) -> None:
        start = clock[rank]
        if a.is_compute:
            local, remote = _inputs(a, routes, backward_kind)
            start = max([start, *(done[x] for x in local + remote)])
            if remote:
                consumed.add(_recv_of(a))
            end = start + durations(a)
            spans[rank].append(Span(start, end, a))
            done[a] = end
        else:
            if a.kind.category == "recv":
                posted[a], end = start, start + durations(a)
            elif _meets_tied(a):
                peers = routes.tied_peers(rank)
                start = max([start, *(reduced.get(p, clock[p]) for p in peers)])
                end = reduced[rank] = start + durations(a)
            else:
                end = start + durations(a)
                if a.kind.category != "step":
                    done[a] = end
            if end > start:  # the default durations give data-plane actions none
                spans[rank].append(Span(start, end, a))
        clock[rank] = end

    # Passes over the ranks in alternating directions: forwards flow up the ranks and backwards
    # down, so a pipeline of n ranks settles in a few passes instead of n (a chain of 1,024
    # stages: seconds of the compile). Each action's times depend only on what it waits for,
    # never on the order the ranks are visited in.
    progress, order = True, list(actions)
    while progress:
        progress = False
        for rank in order:
            acts = actions[rank]
            while pos[rank] < len(acts):
                a = acts[pos[rank]]
                if blocker(rank, a) is not None:
                    break
                run(rank, a)
                pos[rank] += 1
                progress = True
        order.reverse()

    stuck = {r: pos[r] for r in actions if pos[r] < len(actions[r])}
    if stuck:
        lines = [
            f"worker rank {r} blocks at action #{i} '{actions[r][i]}': {blocker(r, actions[r][i])}"
            for r, i in stuck.items()
        ]
        raise ScheduleError("schedule deadlocks:\n  " + "\n  ".join(lines))
    _check_complete(actions, topo, routes, done, posted, consumed)
    return Timeline(spans, max(clock.values(), default=0.0))


@dataclass(frozen=True, slots=True)
class Steady:
    step: float
    """The time one step adds when steps follow each other (``steps_async``, or sent ahead)."""
    bubble_fraction: float
    """Of that step."""
    lone: float
    """A step on its own (``job.step`` waits for each): its makespan."""


def steady_step(
    actions: dict[int, list[Action]], topo: Topology, routes: Routes, durations: Callable[[Action], float]
) -> Steady:
    """A step as it runs after another: the makespan of two steps back to back less that of one.
    A lone step's makespan counts the last rank waiting for the first forward and the first rank
    finishing its last weight gradients and optimizer step; back to back, a rank's next step
    starts when its own optimizer step ends, so the tail of one step hides the head of the next
    (at costs measured on the 2-rank MLP job of bench/pipeline.py, a ZB-H2 step back to back
    4.2% shorter than a lone one; a ZB-H1 step no shorter). Tied parameters' reductions are
    waited for as in the first step only: the second's may read a little early."""
    M = topo.microbatches
    later = {
        r: [a if a.microbatch is None else Action(a.stage, a.kind, a.microbatch + M) for a in acts]
        for r, acts in actions.items()
    }
    one = simulate(actions, topo, routes, durations)
    two = simulate({r: actions[r] + later[r] for r in actions}, replace(topo, microbatches=2 * M), routes, durations)
    step = two.makespan - one.makespan
    busy = sum(s.end - s.start for spans in one.spans.values() for s in spans)
    return Steady(step, 0.0 if step <= 0 else 1.0 - busy / (step * len(one.spans)), one.makespan)


def _check_complete(actions, topo, routes, done, posted, consumed) -> None:
    problems = []
    for rank, acts in actions.items():
        if routes.reduces_on(rank) and not any(_meets_tied(a) for a in acts):
            problems.append(f"rank {rank} holds a tied parameter but never runs REDUCE_GRAD")
    used = {a.kind for acts in actions.values() for a in acts}
    backwards = [k for k in kinds() if k.grads]
    for s in range(topo.num_stages):
        for m in range(topo.microbatches):
            if Action(s, Kind.FORWARD, m) not in done:
                problems.append(f"rank {topo.rank_of(s)} never runs {Action(s, Kind.FORWARD, m)}")
            ran = [k for k in backwards if Action(s, k, m) in done]
            if not {"input", "weight"} <= {g for k in ran for g in ("input", "weight") if k.grads in (g, "both")}:
                # name what the schedule's own kinds leave out: B, or the half of a split one
                missing = [Action(s, k, m) for k in backwards if k in used and k not in ran] or [
                    Action(s, Kind.BACKWARD, m)
                ]
                problems.append(f"rank {topo.rank_of(s)} never runs {' or '.join(map(str, missing))}")
    for recv in posted.keys() - consumed:
        problems.append(f"rank {topo.rank_of(recv.stage)} posts {recv} but nothing consumes it")
    if problems:
        raise ScheduleError("schedule is incomplete:\n  " + "\n  ".join(problems[:20]))


def island_order(actions: list[Action], collectives: dict[int, dict[str, list[dict]]], last_stage: int) -> list[str]:
    """The island collectives one island rank runs in a step, in order, from its action list and
    each sharded stage's collectives (as read off that rank's program): a forward runs the
    stage's forward ones (and the loss's, on the last stage), a backward its backward ones."""
    out = []
    for a in actions:
        found = collectives.get(a.stage)
        if found is None or not a.is_compute:
            continue
        parts = ["forward", "loss_forward"] if a.kind.direction == "forward" else ["backward"]
        if a.stage != last_stage:
            parts = [p for p in parts if p != "loss_forward"]
        for part in parts:
            out.extend(f"{a} {c['op']}{c['shape']}" for c in found.get(part, ()))
    return out


def check_islands(orders: dict[int, list[str]], where: str) -> None:
    """An island's ranks meet at every collective: each must run the same ones in the same order,
    or the first to differ waits forever (gloo matches collectives by order, not by name)."""
    first = min(orders)
    for member, order in orders.items():
        if order == orders[first]:
            continue
        at = next(
            (i for i, (a, b) in enumerate(zip(order, orders[first])) if a != b), min(len(order), len(orders[first]))
        )
        mine = order[at] if at < len(order) else "nothing (its list ends)"
        theirs = orders[first][at] if at < len(orders[first]) else "nothing (its list ends)"
        raise ScheduleError(
            f"{where}: island rank {member} would deadlock at collective #{at}: it runs {mine}, "
            f"while island rank {first} runs {theirs}"
        )
