"""The short calibration behind schedule="auto": what each stage's actions cost on the real workers.

The job is loaded once per candidate schedule, as throw-away copies beside each other: they
train a few steps on the example batch, one step of each in turn (a machine whose speed drifts
from minute to minute then slows them all alike), the workers' timelines give each stage's
forward, backward and backward halves in seconds (less the waits on the data plane inside them),
and the copies are closed. The copies are on the workers together: their memory adds up. The
real job starts from the model's own weights with those costs (``JobConfig.schedule_costs``),
and the compiler simulates every candidate schedule at its own
(controller/compiler/autoschedule.py). Each candidate is measured under its own order because an
action's cost depends on it: on 2 ranks of the MLP job of bench/pipeline.py, GPipe's forwards one
after another ran 17% faster per step than 1F1B's alternation, which costs measured under 1F1B
did not predict.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from atoll.core.config import JobConfig
from atoll.core.names import SCHEDULE_COST_SEPARATOR, STEP_OVERHEAD_COST, STEP_ROUND_TRIP_COST

CALIBRATION_STEPS = 10
"""Steps each calibration copy trains; the first warms up and is not measured. One step's wall
time varies by up to 15% from the next on a busy 2-core machine (the MLP job of
bench/pipeline.py, 2 ranks: 181-302 ms for 1F1B's 14 steps in one run, with no trend from the
first steps to the later ones): the median of nine, not the mean of two, is what a prediction
within 10% needs."""

MAX_CALIBRATION_STEPS = 30
"""While the two fastest copies' median steps lie within ``CLOSE`` of each other, every copy
trains one more step, up to this many in all: a longer measurement only where the choice is
close. The median of nine such steps is itself about 5% uncertain, and with ten steps two
candidates measured apart in the bench afterwards had been read level (the GPT example: 1F1B and
GPipe predicted 0.2% apart, GPipe then measured 5% faster; the MLP job at 4 stages: GPipe
predicted 4% ahead, ZB-H1 then measured 6% faster)."""

CLOSE = 0.05
"""How near (relative) the two fastest copies' median steps must be for the calibration to go on."""


def calibration_configs(config: JobConfig) -> list[JobConfig]:
    """The throw-away copies to measure: the job's own settings under each candidate schedule
    (``JobConfig.auto_candidates``), never saved or resumed, sharing their workers."""
    return [
        dataclasses.replace(
            config,
            schedule=schedule,
            name=f"{config.name} calibration ({schedule})",
            detached=False,
            auto_resume=False,
            checkpoint_path="",
            exclusive=False,
        )
        for schedule in config.auto_candidates()
    ]


def costs_of(summary: dict, wall_s: float) -> dict[str, float]:
    """One calibration copy's costs from its timeline summary and its steps' median wall time: each
    action's seconds, the step's time beyond what the simulation of its own schedule at those
    seconds gives (the control path, which every schedule pays alike), and of that the part
    outside the workers' compute window (the call's way in and out, which steps sent together hide)."""
    predicted = summary.get("predicted_step_s_at_measured_costs") or 0.0
    overhead = max(0.0, wall_s - predicted)
    window = summary.get("measured_step_window_s")
    round_trip = 0.0 if window is None else min(overhead, max(0.0, wall_s - window))
    return {**summary["measured_costs"], STEP_OVERHEAD_COST: overhead, STEP_ROUND_TRIP_COST: round_trip}


def close_call(walls: list[list[float]]) -> bool:
    """Whether the two fastest copies' median steps lie within ``CLOSE`` of each other."""
    medians = sorted(statistics.median(times) for times in walls)
    return len(medians) > 1 and medians[1] <= medians[0] * (1 + CLOSE)


def run_copies(submit, configs: list[JobConfig], batch: tuple) -> dict[str, dict[str, float]]:
    """Load every copy (``submit(config)`` returns its Job), train them ``CALIBRATION_STEPS``
    steps on ``batch`` one step of each in turn (up to ``MAX_CALIBRATION_STEPS`` while the
    fastest two are a ``close_call``), close them; each schedule's ``costs_of``."""
    jobs = []
    try:
        for config in configs:
            jobs.append(submit(config))
        for job in jobs:
            job.step(*batch)  # the first step warms up
        walls: list[list[float]] = [[] for _ in jobs]
        measured = 0
        while measured < CALIBRATION_STEPS - 1 or (measured < MAX_CALIBRATION_STEPS - 1 and close_call(walls)):
            for job, times in zip(jobs, walls):
                started = time.perf_counter()
                job.step(*batch)
                times.append(time.perf_counter() - started)
            measured += 1
        return {
            config.schedule: costs_of(job.timeline(last=measured).summary, statistics.median(times))
            for config, job, times in zip(configs, jobs, walls)
        }
    finally:
        for job in jobs:
            job.close()


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
