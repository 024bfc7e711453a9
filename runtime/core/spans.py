"""What a worker records of each step it runs: one span per action of its list, and one per wait
on the data plane inside an action, on the worker's wall clock. An action's span is in its kind's
category (``ActionSpec.category``: compute, send, recv, collective, step, local). The controller
gathers them into timelines (controller/compiler/trace.py); the executor keeps the last
``KEPT_STEPS`` steps.

Each action also runs inside a ``torch.profiler.record_function`` range named ``atoll <action>``,
so a user's own torch profiler trace shows where the runtime's actions begin and end.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from atoll._rpc import atoll_pb2 as pb

KEPT_STEPS = 64
"""Steps whose spans a worker keeps per job (a few hundred bytes per action)."""

WAIT = "wait"
"""A wait on the data plane: ``wait <RECV action>`` inside the compute that takes a receive,
``wait sends`` where the step waits for its sends to be taken."""


@dataclass(slots=True)
class StepSpans:
    step: int
    spans: list[tuple[str, str, float, float]] = field(default_factory=list)
    """(name, category, start, end) in time.time() seconds, in the order they ended."""

    def to_pb(self, rank: int) -> pb.StepTimeline:
        return pb.StepTimeline(
            step=self.step,
            rank=rank,
            spans=[pb.ActionSpan(name=n, category=c, start_s=s, end_s=e) for n, c, s, e in self.spans],
        )


class History:
    """The spans of a job's last KEPT_STEPS steps on this worker."""

    def __init__(self, kept: int = KEPT_STEPS):
        self._steps: deque[StepSpans] = deque(maxlen=kept)

    def add(self, spans: StepSpans) -> None:
        self._steps.append(spans)

    def select(self, steps: list[int], last: int) -> list[StepSpans]:
        """The listed steps this worker still holds, or else its last ``last`` (at least one)."""
        held = list(self._steps)
        if steps:
            wanted = set(steps)
            return [s for s in held if s.step in wanted]
        return held[-max(1, last) :]
