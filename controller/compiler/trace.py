"""Timelines: what each worker did in a step, next to what the compiler predicted, as Chrome trace
JSON (opens in Perfetto and chrome://tracing).

Rows: process "measured" has one row per worker, with its actions and, nested in them, its waits
on the data plane; process "predicted" has one row per pipeline rank: the plan's action lists run
through the compiler's simulator (controller/compiler/simulate.py) with the costs its actions had in the
traced steps (mean per stage and kind, less the waits inside), laid over each training step from
where its first compute started. Flow arrows go from each send to the wait of the receive that
took it on the peer.

Bubble fraction, over the window the simulation predicts it for: a training step's compute window
(the first forward to start on any worker until the last compute to end on any; evaluation and
inference steps are drawn but not counted). A worker's bubble is
the share of that window it spent idle: outside its actions, or inside one waiting on the data
plane (a compute waiting for its receive, a step waiting for its sends). Reported per worker:
measured, predicted by the plan (F = 1, B = 2, data-plane actions free: the plan's
``predicted_bubble_fraction``), and predicted at the measured costs (which adds imbalance and the
data plane's own cost, and leaves out only what the simulator does not model: contention for
cores, wake-up latency, clock skew between hosts, whose wall clocks are compared directly).
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from atoll._rpc import atoll_pb2 as pb
from atoll.controller.compiler.pipeline import CompiledPipeline
from atoll.controller.compiler.simulate import Timeline, matching_recvs, simulate, steady_step
from atoll.core.actions import Action, ActionSpec

MEASURED_PID, PREDICTED_PID = 1, 2


@dataclass(frozen=True, slots=True)
class WorkerSteps:
    """One worker's spans of the gathered steps."""

    index: int
    """Worker index in the job (controller/compiler/topology.py)."""
    label: str
    steps: Sequence[pb.StepTimeline]
    worker_id: str = ""
    host: str = ""
    device: str = "cpu"
    cpus: Sequence[int] = ()
    """The CPUs the worker's process may run on; empty when unknown."""
    threads: int = 1
    """Its torch intra-op threads."""


def oversubscribed(workers: Sequence[WorkerSteps]) -> list[dict]:
    """Hosts whose CPU workers run more compute threads than they have CPUs between them. There
    a busy worker waits for a core and fewer busy workers run faster, so measured bubbles drift
    from a prediction that assumes a device per worker (README: Limits)."""
    by_host: dict[str, list[WorkerSteps]] = defaultdict(list)
    for w in workers:
        if w.device.startswith("cpu") and w.cpus:
            by_host[w.host].append(w)
    found = []
    for host, on_host in sorted(by_host.items()):
        threads, cpus = sum(max(1, w.threads) for w in on_host), len({c for w in on_host for c in w.cpus})
        if threads > cpus:
            found.append({"host": host, "workers": [w.index for w in on_host], "threads": threads, "cpus": cpus})
    return found


def oversubscription_note(hosts: Sequence[dict]) -> str | None:
    """One line for a person, or None when every host has a CPU per compute thread."""
    if not hosts:
        return None
    each = "; ".join(
        f"{h['threads']} compute threads of workers {h['workers']} on {h['cpus']} CPUs of {h['host']}" for h in hosts
    )
    return f"oversubscribed: {each}. The prediction assumes a device per worker; measured bubbles drift from it here"


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _overlap(start: float, end: float, window: tuple[float, float]) -> float:
    return max(0.0, min(end, window[1]) - max(start, window[0]))


def _actions(spans: Sequence[pb.ActionSpan]) -> list[tuple[pb.ActionSpan, list[pb.ActionSpan]]]:
    """One worker's actions in one step, in time order, each with the waits on the data plane
    that lie inside it (a wait outside every action, after the last send, belongs to none)."""
    actions = sorted((s for s in spans if s.category != "wait"), key=lambda s: s.start_s)
    starts = [a.start_s for a in actions]
    inside: list[list[pb.ActionSpan]] = [[] for _ in actions]
    for w in spans:
        i = bisect.bisect_right(starts, w.start_s) - 1 if w.category == "wait" else -1
        if i >= 0 and w.end_s <= actions[i].end_s:
            inside[i].append(w)
    return list(zip(actions, inside))


def _busy(spans: Sequence[pb.ActionSpan], window: tuple[float, float]) -> float:
    """Seconds of ``window`` a worker spent in its actions (one worker, one step), less the waits
    on the data plane inside them."""
    return sum(
        _overlap(a.start_s, a.end_s, window) - sum(_overlap(w.start_s, w.end_s, window) for w in waits)
        for a, waits in _actions(spans)
    )


def _window(spans: Sequence[pb.ActionSpan]) -> tuple[float, float] | None:
    computes = [s for s in spans if s.category == "compute"]
    if not computes:
        return None
    return min(s.start_s for s in computes), max(s.end_s for s in computes)


def simulated_bubbles(timeline: Timeline) -> dict[int, float]:
    """Per pipeline rank: the share of the simulated compute window the rank spends outside its
    actions (the measured bubble's definition, applied to the simulation)."""
    computes = [s for spans in timeline.spans.values() for s in spans if s.action.is_compute]
    if not computes:
        return {r: 0.0 for r in timeline.spans}
    window = (min(s.start for s in computes), max(s.end for s in computes))
    return {
        r: 1.0 - sum(_overlap(s.start, s.end, window) for s in spans) / (window[1] - window[0])
        for r, spans in timeline.spans.items()
    }


def mean_costs(steps: Sequence[dict[int, list[pb.ActionSpan]]]) -> dict[tuple[int, ActionSpec], float]:
    """Each action's mean measured duration (less the waits inside it) by stage and kind, over ``steps``."""
    total: dict[tuple[int, ActionSpec], float] = defaultdict(float)
    count: dict[tuple[int, ActionSpec], int] = defaultdict(int)
    for spans_of in steps:
        for spans in spans_of.values():
            for span, waits in _actions(spans):
                a = Action.parse(span.name)
                total[a.stage, a.kind] += span.end_s - span.start_s - sum(w.end_s - w.start_s for w in waits)
                count[a.stage, a.kind] += 1
    return {key: total[key] / count[key] for key in total}


def build(compiled: CompiledPipeline, workers: Sequence[WorkerSteps]) -> tuple[dict, dict]:
    """(Chrome trace, summary) of the steps the workers hold."""
    topo = compiled.topology
    rank_of_worker = {w.index: topo.coordinates(w.index)[1] for w in workers}
    by_step: dict[int, dict[int, list[pb.ActionSpan]]] = {}
    for w in workers:
        for st in w.steps:
            by_step.setdefault(st.step, {})[w.index] = list(st.spans)
    all_spans = [s for step in by_step.values() for spans in step.values() for s in spans]
    origin = min((s.start_s for s in all_spans), default=0.0)
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": MEASURED_PID, "args": {"name": "measured"}},
        {"ph": "M", "name": "process_sort_index", "pid": MEASURED_PID, "args": {"sort_index": 0}},
        {"ph": "M", "name": "process_name", "pid": PREDICTED_PID, "args": {"name": "predicted"}},
        {"ph": "M", "name": "process_sort_index", "pid": PREDICTED_PID, "args": {"sort_index": 1}},
    ]
    for w in workers:
        events.append(
            {"ph": "M", "name": "thread_name", "pid": MEASURED_PID, "tid": w.index, "args": {"name": w.label}}
        )
    for r in sorted(compiled.timeline.spans):
        name = f"predicted rank {r}"
        events.append({"ph": "M", "name": "thread_name", "pid": PREDICTED_PID, "tid": r, "args": {"name": name}})

    busy = {w.index: 0.0 for w in workers}
    window_total = 0.0
    flow_ids = itertools.count(1)
    flows, unmatched = 0, []
    trained: dict[int, float] = {}  # training step -> its compute window's start
    windows_s: list[float] = []  # each training step's compute window, first action to last
    for step in sorted(by_step):
        spans_of = by_step[step]
        for index, spans in spans_of.items():
            for s in spans:
                events.append(
                    {
                        "ph": "X",
                        "name": s.name,
                        "cat": s.category,
                        "ts": _us(s.start_s - origin),
                        "dur": _us(s.end_s - s.start_s),
                        "pid": MEASURED_PID,
                        "tid": index,
                        "args": {"step": step},
                    }
                )
        made, missing = _flows(compiled, spans_of, step, origin, flow_ids, events)
        flows += made
        unmatched += missing
        windows = [w for w in map(_window, spans_of.values()) if w is not None]
        training = any(s.name.endswith("STEP") for spans in spans_of.values() for s in spans)
        if len(spans_of) != len(workers) or not windows or not training:
            continue  # a worker no longer holds it, or an evaluation the schedule's prediction is not for
        start, end = min(w[0] for w in windows), max(w[1] for w in windows)
        window_total += end - start
        for index, spans in spans_of.items():
            busy[index] += _busy(spans, (start, end))
        trained[step] = start
        windows_s.append(end - start)
    planned = simulated_bubbles(compiled.timeline)
    at_costs: dict[int, float] = {}
    mean: dict[tuple[int, ActionSpec], float] = {}
    steady_s = None
    if trained:  # the plan's schedule, simulated with the costs its actions had in these steps
        mean = mean_costs([by_step[step] for step in trained])

        def measured(a: Action) -> float:
            return mean.get((a.stage, a.kind), 0.0)

        timeline = simulate(compiled.lowered.actions, topo, compiled.routes, measured)
        steady_s = steady_step(compiled.lowered.actions, topo, compiled.routes, measured).step
        at_costs = simulated_bubbles(timeline)
        for step, start in trained.items():
            _predicted_rows(timeline, start, origin, step, events)
    crowded = oversubscribed(workers)
    summary = {
        "steps": sorted(by_step),
        "origin_s": origin,
        "schedule": topo.schedule,
        "microbatches": topo.microbatches,
        "predicted_bubble_fraction": compiled.timeline.bubble_fraction,
        "workers": [
            {
                "worker": w.index,
                "worker_id": w.worker_id,
                "label": w.label,
                "rank": rank_of_worker[w.index],
                "measured_bubble": None if window_total <= 0 else 1.0 - busy[w.index] / window_total,
                "predicted_bubble": planned.get(rank_of_worker[w.index]),
                "predicted_bubble_at_measured_costs": at_costs.get(rank_of_worker[w.index]),
            }
            for w in workers
        ],
        "flows": flows,
        "unmatched_sends": unmatched,
        "oversubscribed": crowded,
        "note": oversubscription_note(crowded),
        "predicted_rows_for_steps": sorted(trained),
        # seconds per action by stage and kind ("0F", "2B", "1I", "0STEP"): what schedule="auto" simulates with
        "measured_costs": {f"{stage}{kind.code}": s for (stage, kind), s in mean.items()},
        "predicted_step_s_at_measured_costs": timeline.makespan if trained else None,
        # the same costs, a step as it runs after another (simulate.steady_step)
        "predicted_steady_step_s_at_measured_costs": steady_s,
        "measured_step_window_s": statistics.median(windows_s) if windows_s else None,
    }
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"atoll": summary}}, summary


def _flows(compiled, spans_of, step, origin, ids, events) -> tuple[int, list[str]]:
    """Arrows from every send in the step to the wait of each receive that took it."""
    topo, routes = compiled.topology, compiled.routes
    made, missing = 0, []
    waits = {
        (index, s.name.removeprefix("wait ")): s
        for index, spans in spans_of.items()
        for s in spans
        if s.category == "wait"
    }
    for index, spans in spans_of.items():
        replica, _, tp = topo.coordinates(index)
        for send in (s for s in spans if s.category == "send"):
            for recv in matching_recvs(Action.parse(send.name), routes):
                peer = topo.worker(replica, topo.rank_of(recv.stage), tp)
                wait = waits.get((peer, str(recv)))
                if wait is None:
                    if peer in spans_of:  # the peer's spans are here but it never took the receive
                        missing.append(f"step {step}: worker {index} {send.name} -> worker {peer} {recv}")
                    continue
                flow = next(ids)
                common = {"name": f"{send.name} -> {recv}", "cat": "dataflow", "id": flow, "pid": MEASURED_PID}
                events.append({**common, "ph": "s", "tid": index, "ts": _us((send.start_s + send.end_s) / 2 - origin)})
                events.append(
                    {**common, "ph": "f", "bp": "e", "tid": peer, "ts": _us((wait.start_s + wait.end_s) / 2 - origin)}
                )
                made += 1
    return made, missing


def _predicted_rows(timeline: Timeline, start: float, origin: float, step: int, events: list) -> None:
    """A simulated step laid over a measured one, from the step's first compute."""
    for rank, spans in timeline.spans.items():
        for s in spans:
            events.append(
                {
                    "ph": "X",
                    "name": str(s.action),
                    "cat": "predicted",
                    "ts": _us(start + s.start - origin),
                    "dur": _us(s.end - s.start),
                    "pid": PREDICTED_PID,
                    "tid": rank,
                    "args": {"step": step},
                }
            )
