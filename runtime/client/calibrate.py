"""The short calibration behind schedule="auto": what each stage's actions cost on the real workers.

The job is loaded once per candidate schedule, as throw-away copies beside each other: they
train a few steps on the example batch, one step of each in turn (a machine whose speed drifts
from minute to minute then slows them all alike), the workers' timelines give each stage's
forward, backward and backward halves in seconds (less the waits on the data plane inside them),
then each copy in turn runs a few rounds of steps back to back, as training sends them (two calls
of ``CALL_STEPS`` sent together), and the copies are closed. The copies are on the workers
together: their memory adds up. The real job starts from the model's own weights with those
costs (``JobConfig.schedule_costs``), and the compiler simulates every candidate schedule at its
own (controller/compiler/autoschedule.py). Each candidate is measured under its own order because
an action's cost depends on it: on 2 ranks of the MLP job of bench/pipeline.py, GPipe's forwards
one after another ran 17% faster per step than 1F1B's alternation, which costs measured under
1F1B did not predict.

Given ``auto_microbatches`` or ``auto_virtual_stages``, every candidate is calibrated in each
layout too (``JobConfig.layouts``: microbatches x chunks per worker), all the copies loaded and run
in turn together, and the job runs in the layout whose fastest copy stepped fastest
(``calibrated``). The layout is chosen here, on what the copies measured, because the program is
exported at one microbatch's shape: the compiler then chooses among the schedules of that layout by
simulating them at its copies' costs, which for a calibrated candidate gives back the step its
copy measured (its simulation plus the overheads measured beyond it; the simulation alone where
that is longer).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

from atoll.core.config import JobConfig, layout_name
from atoll.core.names import SCHEDULE_COST_SEPARATOR, STEP_BACK_TO_BACK_OVERHEAD_COST, STEP_OVERHEAD_COST

CALIBRATION_STEPS = 10
"""Steps each calibration copy trains; the first warms up and is not measured. One step's wall
time varies by up to 15% from the next on a busy 2-core machine (the MLP job of
bench/pipeline.py, 2 ranks: 181-302 ms for 1F1B's 14 steps in one run, with no trend from the
first steps to the later ones): the median of nine, not the mean of two, is what a prediction
within 10% needs."""

CALL_STEPS = 4
"""Steps to a call in the back-to-back rounds (``back_to_back``), as bench/pipeline.py sends them
by default (examples/train_gpt.py: 8)."""

BACK_TO_BACK_ROUNDS = 3
"""Back-to-back rounds each copy runs (``back_to_back``), one copy after another in turn."""

MAX_BACK_TO_BACK_ROUNDS = 8
"""While the two fastest copies' median back-to-back steps lie within ``CLOSE`` of each other,
every copy runs one more round, up to this many in all: a longer measurement only where the
choice (made on a step back to back) is close. With ten steps waited for, two candidates measured
apart in the bench afterwards had been read level (the GPT example: 1F1B and GPipe predicted 0.2%
apart, GPipe then measured 5% faster; the MLP job at 4 stages: GPipe predicted 4% ahead, ZB-H1
then measured 6% faster)."""

CLOSE = 0.05
"""How near (relative) the two fastest copies' median steps must be for the calibration to go on."""


@dataclass(frozen=True, slots=True)
class Measured:
    """What one calibration copy measured."""

    config: JobConfig
    costs: dict[str, float]
    """``costs_of``: each action's seconds and the step's overheads beyond its simulation."""
    step_s: float
    """Its median step back to back, or waited for where that was shorter: the step the compiler
    predicts for it at ``costs`` (autoschedule.Candidate.predicted_step_s), unless the simulation
    of its actions alone is longer than what was measured."""


def calibration_configs(config: JobConfig) -> list[JobConfig]:
    """The throw-away copies to measure: the job's own settings under each candidate schedule
    (``JobConfig.auto_candidates``) in each of its layouts (``JobConfig.layouts``), never saved or
    resumed, sharing their workers."""
    copies = []
    layouts = config.layouts()
    for microbatches, chunks in layouts:
        layout = dataclasses.replace(
            config, microbatches=microbatches, virtual_stages=chunks, auto_microbatches=(), auto_virtual_stages=()
        )
        for schedule in layout.auto_candidates():
            label = schedule if len(layouts) == 1 else f"{schedule}, {layout_name(microbatches, chunks)}"
            copies.append(
                dataclasses.replace(
                    layout,
                    schedule=schedule,
                    name=f"{config.name} calibration ({label})",
                    base_name="",  # a copy of a resident base is not one: the name is the base's
                    detached=False,
                    auto_resume=False,
                    checkpoint_path="",
                    exclusive=False,
                )
            )
    return copies


def costs_of(summary: dict, wall_s: float, back_to_back_s: float | None = None) -> dict[str, float]:
    """One calibration copy's costs from its timeline summary, its steps' median wall time waited
    for and its median step back to back: each action's seconds; the step's time beyond what the
    simulation of its own schedule at those seconds gives (the control path, which every schedule
    pays alike); and a step back to back beyond its simulation so (simulate.steady_step): what
    steps sent together still pay, the batch's bytes arriving on cores the stages compute on
    among it, where the call's way in and out is hidden by the next call."""
    predicted = summary.get("predicted_step_s_at_measured_costs") or 0.0
    costs = {**summary["measured_costs"], STEP_OVERHEAD_COST: max(0.0, wall_s - predicted)}
    steady = summary.get("predicted_steady_step_s_at_measured_costs")
    if back_to_back_s is not None and steady is not None:
        costs[STEP_BACK_TO_BACK_OVERHEAD_COST] = max(0.0, back_to_back_s - steady)
    return costs


def close_call(walls: list[list[float]]) -> bool:
    """Whether the two fastest copies' median steps lie within ``CLOSE`` of each other."""
    medians = sorted(statistics.median(times) for times in walls)
    return len(medians) > 1 and medians[1] <= medians[0] * (1 + CLOSE)


def back_to_back(job, batch: tuple) -> float:
    """Seconds per step of a call run right after another: two calls of ``CALL_STEPS`` steps sent
    together, the time between their ends over ``CALL_STEPS``. The second call waits on the
    workers while the first runs, so no call's way in lies between the two ends, and each end
    carries the same way back to the client."""
    first = job.steps_async([batch] * CALL_STEPS)[-1]
    second = job.steps_async([batch] * CALL_STEPS)[-1]
    first.result()
    ended = time.perf_counter()
    second.result()
    return (time.perf_counter() - ended) / CALL_STEPS


def run_copies(submit, configs: list[JobConfig], batch: tuple) -> list[Measured]:
    """Load every copy (``submit(config)`` returns its Job), train them ``CALIBRATION_STEPS``
    steps on ``batch`` one step of each in turn and read their timelines, then run
    ``BACK_TO_BACK_ROUNDS`` rounds of ``back_to_back`` one copy after another (up to
    ``MAX_BACK_TO_BACK_ROUNDS`` while the fastest two are a ``close_call``), close them; what each
    measured, in the order of ``configs``."""
    jobs = []
    try:
        for config in configs:
            jobs.append(submit(config))
        for job in jobs:
            job.step(*batch)  # the first step warms up
        walls: list[list[float]] = [[] for _ in jobs]
        for _ in range(CALIBRATION_STEPS - 1):
            for job, times in zip(jobs, walls):
                started = time.perf_counter()
                job.step(*batch)
                times.append(time.perf_counter() - started)
        summaries = [job.timeline(last=CALIBRATION_STEPS - 1).summary for job in jobs]
        together: list[list[float]] = [[] for _ in jobs]
        rounds = 0
        while rounds < BACK_TO_BACK_ROUNDS or (rounds < MAX_BACK_TO_BACK_ROUNDS and close_call(together)):
            for job, times in zip(jobs, together):
                times.append(back_to_back(job, batch))
            rounds += 1
        return [
            Measured(
                config,
                costs_of(summary, statistics.median(lone), statistics.median(steps)),
                min(statistics.median(lone), statistics.median(steps)),
            )
            for config, summary, lone, steps in zip(configs, summaries, walls, together)
        ]
    finally:
        for job in jobs:
            job.close()


def calibrated(config: JobConfig, measured: list[Measured]) -> JobConfig:
    """``config`` to submit after the calibration: in the layout whose fastest copy measured the
    shortest step (of equal ones, the job's own, then the fewest microbatches and chunks), with the
    costs its copies measured (``combined``) and, where several layouts were measured, each one's
    step (``JobConfig.layout_steps``)."""
    steps: dict[tuple[int, int], float] = {}
    for m in measured:
        layout = (m.config.microbatches, m.config.virtual_stages)
        steps[layout] = min(steps.get(layout, m.step_s), m.step_s)
    own = (config.microbatches, config.virtual_stages)
    chosen = min(steps, key=lambda layout: (steps[layout], layout != own, layout))
    at_chosen = [m for m in measured if (m.config.microbatches, m.config.virtual_stages) == chosen]
    return dataclasses.replace(
        config,
        microbatches=chosen[0],
        virtual_stages=chosen[1],
        schedule_costs=combined({m.config.schedule: m.costs for m in at_chosen}),
        layout_steps={layout_name(*layout): s for layout, s in sorted(steps.items())} if len(steps) > 1 else {},
    )


def combined(per_schedule: dict[str, dict[str, float]]) -> dict[str, float]:
    """Seconds per stage and action kind, each candidate's own under its name ("gpipe/0F",
    "zb_h1/0I", ...), and each kind's mean over the candidates that ran it without a name ("0F",
    "0B", ...: for a plan printed without a calibration of its own)."""
    seen: dict[str, list[float]] = {}
    own: dict[str, float] = {}
    for schedule, costs in per_schedule.items():
        for key, seconds in costs.items():
            seen.setdefault(key, []).append(seconds)
            own[f"{schedule}{SCHEDULE_COST_SEPARATOR}{key}"] = seconds
    return {key: sum(values) / len(values) for key, values in seen.items()} | own
