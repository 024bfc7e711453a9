"""A job's timelines as the client gets them: Chrome trace JSON (measured rows per worker,
predicted rows per pipeline rank, send -> receive arrows) and the bubble fractions beside it.
Built by the controller (controller/compiler/trace.py) from the spans workers record (atoll.core.spans)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Trace:
    events: dict
    """Chrome trace JSON: open the saved file in https://ui.perfetto.dev or chrome://tracing."""
    summary: dict
    """Steps covered, per worker its measured and predicted bubble fraction, arrow counts, hosts
    whose CPU workers share too few CPUs ("oversubscribed") and a line saying so ("note")."""

    @property
    def bubbles(self) -> dict[int, tuple[float | None, float | None]]:
        """Worker index -> (measured, predicted) bubble fraction."""
        return {w["worker"]: (w["measured_bubble"], w["predicted_bubble"]) for w in self.summary["workers"]}

    def step_starts(self) -> dict[str, dict[int, float]]:
        """Worker id -> step number -> when the step's first action began on that worker (wall
        clock, ``time.time()`` seconds). A worker runs the steps of all its jobs one at a time in
        its gang order (but for jobs attached to a resident base, whose steps interleave), so
        merging these for several jobs on one worker gives that order."""
        origin, ids = self.summary["origin_s"], {w["worker"]: w["worker_id"] for w in self.summary["workers"]}
        starts: dict[str, dict[int, float]] = {}
        for e in self.measured_spans():
            of_worker = starts.setdefault(ids[e["tid"]], {})
            at = origin + e["ts"] / 1e6
            of_worker[e["args"]["step"]] = min(at, of_worker.get(e["args"]["step"], at))
        return starts

    def measured_spans(self) -> list[dict]:
        """The spans the workers measured (not the predicted rows): each with the worker index as
        ``tid``, ``cat`` its action's category or ``wait``, ``ts``/``dur`` in microseconds from the
        trace's origin, and its step in ``args``."""
        # the measured rows' pid: controller/compiler/trace.py MEASURED_PID
        return [e for e in self.events["traceEvents"] if e["ph"] == "X" and e["pid"] == 1]

    def save(self, path: str | os.PathLike) -> None:
        """Write the Chrome trace JSON to ``path``."""
        with open(path, "w") as f:
            json.dump(self.events, f)

    def plot(self, path: str | os.PathLike) -> None:
        """Render the measured timeline with the predicted rows under it as a PNG (needs
        matplotlib: ``pip install 'atoll[plot]'``)."""
        from atoll.client.plot import render

        render(self, path)
