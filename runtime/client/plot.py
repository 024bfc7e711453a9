"""A PNG of a Trace (atoll.client.trace): one bar row per worker as measured, the predicted rows below,
so a pipeline's staircase and its bubbles can be seen without a browser."""

from __future__ import annotations

import os
import re
import textwrap

from atoll.errors import InvalidInput

COLORS = {"F": "#4c78a8", "B": "#f58518", "wait": "#ffffff", "send": "#54a24b", "step": "#b279a2"}


_COMPUTE = re.compile(r"^\d+(F|B)\d+$")


def _color(event: dict) -> str:
    """Bar colour of a trace event (measured or predicted), by what it did."""
    name = event["name"]
    compute = _COMPUTE.match(name)
    if compute:
        return COLORS[compute.group(1)]
    if event.get("cat") == "wait":
        return COLORS["wait"]
    return COLORS["send"] if "SEND" in name or "RECV" in name else COLORS["step"]


def render(trace, path: str | os.PathLike) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise InvalidInput("a PNG needs matplotlib: pip install 'atoll[plot]'") from None
    events = trace.events["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    rows = sorted(names, key=lambda k: k)  # measured rows (pid 1) above predicted ones (pid 2)
    y_of = {key: len(rows) - 1 - i for i, key in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(14, 0.55 * len(rows) + 1.6))
    for e in events:
        if e["ph"] != "X" or (e["pid"], e["tid"]) not in y_of:
            continue
        color = _color(e)
        y = y_of[(e["pid"], e["tid"])]
        # a wait lies inside the action that waits: drawn after it, it blanks out the idle part
        alpha = 0.55 if e.get("cat") == "predicted" else 1.0
        order = 3 if e.get("cat") == "wait" else 2
        ax.broken_barh([(e["ts"] / 1000, e["dur"] / 1000)], (y - 0.4, 0.8), color=color, alpha=alpha, zorder=order)
    by_worker = {w["worker"]: w for w in trace.summary["workers"]}
    labels = []
    for pid, tid in rows:
        label = names[(pid, tid)]
        w = by_worker.get(tid) if pid == 1 else None
        if w is not None and w["measured_bubble"] is not None:
            label += f"  bubble {w['measured_bubble']:.1%} (plan {w['predicted_bubble']:.1%}"
            at_costs = w.get("predicted_bubble_at_measured_costs")
            label += f", at measured costs {at_costs:.1%})" if at_costs is not None else ")"
        labels.append(label)
    ax.set_yticks([y_of[k] for k in rows], labels, fontsize=8)
    s = trace.summary
    # a host short of CPUs is why measured and predicted differ: say so under the axis
    ax.set_xlabel("time (ms)" + (f"\n{textwrap.fill(s['note'], 110)}" if s.get("note") else ""))
    ax.set_title(
        f"{s['schedule']}, {s['microbatches']} microbatches, steps {s['steps']}: measured rows above, predicted below"
    )
    legend = [
        Patch(color=COLORS["F"], label="forward"),
        Patch(color=COLORS["B"], label="backward"),
        Patch(facecolor=COLORS["wait"], edgecolor="#999999", label="idle / waiting on the data plane"),
        Patch(color=COLORS["send"], label="send / post a receive"),
        Patch(color=COLORS["step"], label="optimizer / collective"),
    ]
    ax.legend(handles=legend, loc="upper right", fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
