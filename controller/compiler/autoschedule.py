"""schedule="auto": every candidate schedule simulated at the job's costs, the fastest chosen.

The candidates are the schedules that run the job's ``virtual_stages`` chunks per worker, less
those the job's other settings refuse (``JobConfig.auto_candidates``). Each is lowered on the job's dataflow and placed
as it would run, then simulated (controller/compiler/simulate.py) with each action's cost:
measured on the workers when the client calibrated (``JobConfig.schedule_costs``, seconds per
stage and kind: computes, and the optimizer step and the posting of transfers as measured; each
candidate's own where it was calibrated under its own order, ``costs_for``), else
in units of the stages' forward FLOPs (a backward twice its forward, each half of a split one
once), two steps back to back less one (``simulate.steady_step``: how training sends its steps),
plus what the calibration measured a step back to back to cost beyond that. The time data spends
on the wire is not simulated. The report lists each candidate's predicted step time (and that of
a step on its own) and why the choice won.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from atoll.controller.compiler.lowering import lower
from atoll.controller.compiler.schedules import build_schedule
from atoll.controller.compiler.simulate import steady_step
from atoll.controller.compiler.topology import Topology
from atoll.core.actions import Action, Kind
from atoll.core.config import JobConfig, layout_of
from atoll.core.dataflow import Dataflow, Routes
from atoll.core.names import SCHEDULE_COST_SEPARATOR, STEP_BACK_TO_BACK_OVERHEAD_COST, STEP_OVERHEAD_COST
from atoll.errors import InvalidInput

EQUAL = 1e-9
"""Predictions this close (relative) are equal: the same makespan summed in another order."""


@dataclass(frozen=True, slots=True)
class Candidate:
    schedule: str
    predicted_step_s: float
    """The simulated step at the costs as it runs after another (simulate.steady_step: steps
    sent together or ahead, as training runs them), plus the overhead measured so
    (``STEP_BACK_TO_BACK_OVERHEAD_COST``; in forward-FLOP units without measured costs), at most
    ``predicted_lone_step_s``. The choice is made on it."""
    predicted_bubble_fraction: float
    predicted_lone_step_s: float
    """A step on its own (``job.step`` waits for each, as the calibration's steps ran), plus the
    whole overhead: longer where one step's tail would hide the next one's head (ZB-H2)."""


@dataclass(frozen=True, slots=True)
class Choice:
    chosen: str
    candidates: list[Candidate]
    costs: str
    """"measured" (the client's calibration) or "flops" (the stages' FLOP counts)."""
    why: str
    layout_steps: dict[str, float]
    """With ``auto_microbatches`` or ``auto_virtual_stages``: each layout's ("MxV") step as its
    fastest calibration copy measured it (``JobConfig.layout_steps``), the shortest of which chose
    the job's."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def durations(costs: dict, flops: list[int]):
    """Each action's cost: the measured seconds of its stage and kind where given, else its stage's
    forward FLOPs in units of the largest (a backward twice that, each half of a split one once).
    A kind measured under one split of the backward stands in for the other: B = I + W, and
    I = W = B / 2 where only B was measured."""
    top = max(flops) or 1
    unit = [f / top for f in flops]

    def measured(stage: int, code: str) -> float | None:
        value = costs.get(f"{stage}{code}")
        return None if value is None else float(value)

    def cost(a: Action) -> float:
        s, code = a.stage, a.kind.code
        if not costs:
            return unit[s] * a.kind.cost if a.is_compute else 0.0
        found = measured(s, code)
        if found is not None:
            return found
        if not a.is_compute:  # a transfer posted, or a step not measured
            return 0.0
        i, w, b = measured(s, "I"), measured(s, "W"), measured(s, "B")
        if a.kind is Kind.BACKWARD and i is not None and w is not None:
            return i + w
        if a.kind in (Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT) and b is not None:
            return b / 2
        raise InvalidInput(f"schedule 'auto': no measured cost for {a} (schedule_costs has {sorted(costs)})")

    return cost


def costs_for(costs: dict, schedule: str) -> dict:
    """The costs to simulate ``schedule`` at: those measured under it ("gpipe/0F", see
    atoll.client.calibrate), else the unnamed ones."""
    prefix = schedule + SCHEDULE_COST_SEPARATOR
    own = {key[len(prefix) :]: value for key, value in costs.items() if key.startswith(prefix)}
    return own or {key: value for key, value in costs.items() if SCHEDULE_COST_SEPARATOR not in key}


def choose(topo: Topology, cfg: JobConfig, dataflow: Dataflow, flops: list[int]) -> tuple[Topology, Choice]:
    """The topology of the fastest candidate, and the choice with every candidate's prediction."""
    rows = []
    for name in cfg.auto_candidates():
        costs = costs_for(cfg.schedule_costs, name)
        cost = durations(costs, flops)
        overhead = float(costs.get(STEP_OVERHEAD_COST, 0.0))
        together = float(costs.get(STEP_BACK_TO_BACK_OVERHEAD_COST, overhead))
        placed = dataclasses.replace(topo, schedule=name)
        routes = Routes(dataflow, placed.stage_ranks)
        steady = steady_step(lower(build_schedule(placed), placed, routes).actions, placed, routes, cost)
        lone = steady.lone + overhead
        # never longer than a step on its own: steps sent together could run as if waited for. The
        # two are measured apart, a few steps each: on a busy 2-core machine the tiny 2-stage job
        # of tests/test_auto_schedule.py read a step on its own only 1.02x one back to back
        rows.append(Candidate(name, min(steady.step + together, lone), steady.bubble_fraction, lone))
    # the fastest, however narrowly; of equal ones (to float rounding) the one listed first (the
    # fewer stashed microbatches). A 2% margin that gave near-ties to the one listed first chose,
    # in one bench run, 1F1B predicted 1.7% behind ZB-H1 and measured 9% behind it
    fastest = min(c.predicted_step_s for c in rows)
    best = next(c for c in rows if c.predicted_step_s <= fastest * (1 + EQUAL))
    others = sorted((c for c in rows if c is not best), key=lambda c: c.predicted_step_s)
    unit = "s" if cfg.schedule_costs else " forward-FLOP units"
    step = f"{best.predicted_step_s:.4g}{unit} ({best.predicted_bubble_fraction:.1%} bubble)"
    if not others:
        why = f"{best.schedule}: the only candidate, {step}"
    else:
        runner = others[0]
        gain = runner.predicted_step_s / best.predicted_step_s - 1
        why = (
            f"{best.schedule}: the shortest predicted step, {step}, {gain:.1%} ahead of {runner.schedule} "
            f"({runner.predicted_step_s:.4g}{unit})"
        )
    if cfg.layout_steps:
        measured = sorted(cfg.layout_steps.items(), key=lambda item: layout_of(item[0]))  # the wire sorts them as text
        steps = ", ".join(f"{s:.4g}s at {layout}" for layout, s in measured)
        why += (
            f"; {cfg.microbatches} microbatches x {cfg.virtual_stages} chunk(s) per worker: "
            f"their fastest calibration copy stepped fastest ({steps})"
        )
    choice = Choice(best.schedule, rows, "measured" if cfg.schedule_costs else "flops", why, cfg.layout_steps)
    return dataclasses.replace(topo, schedule=best.schedule), choice
