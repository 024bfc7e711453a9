"""Timelines: every worker's actions as measured, beside the compiler's prediction, as Chrome
trace JSON with an arrow from each send to the receive that took it (examples/trace_pipeline.py
makes the same run and its picture)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import atoll
from atoll._rpc import atoll_pb2 as pb
from atoll.cli import commands as cli
from atoll.controller.compiler import trace
from atoll.core.actions import Action, Kind
from examples.trace_pipeline import traced_job
from tests.models import compile_locally, mlp
from tests.procs import in_process_cluster

pytestmark = pytest.mark.timeout(300)

STAGES, MICROBATCHES = 4, 16


@pytest.fixture(scope="module")
def gpipe_run(tmp_path_factory):
    """A balanced 4-stage GPipe job with 16 microbatches, and the trace of its last 3 steps."""
    with atoll.LocalCluster(workers=STAGES) as cluster, cluster.client() as client:
        job, trace = traced_job(client, stages=STAGES, microbatches=MICROBATCHES, schedule="gpipe")
        path = tmp_path_factory.mktemp("trace") / "trace.json"
        job.timeline(trace.summary["steps"], path=path)
        yield cluster, client, job, trace, path


def _spans(events, pid):
    return [e for e in events if e["ph"] == "X" and e["pid"] == pid]


def test_trace_json_has_a_row_per_worker_and_predicted_rows(gpipe_run):
    _, _, _, trace, path = gpipe_run
    assert trace.summary["steps"] == [4, 5, 6]  # the client's numbers: 6 steps sent, the last 3 traced
    events = json.loads(path.read_text())["traceEvents"]  # Python's json reads what Perfetto reads
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    measured = sorted(t for p, t in rows if p == 1)
    predicted = sorted(t for p, t in rows if p == 2)
    assert measured == list(range(STAGES)), rows
    assert predicted == list(range(STAGES)), rows
    for worker in measured:  # each worker ran its stage's 16 forwards and 16 backwards in each step
        names = [e["name"] for e in _spans(events, 1) if e["tid"] == worker and e["cat"] == "compute"]
        assert len(names) == 2 * MICROBATCHES * len(trace.summary["steps"])
        assert {n[0] for n in names} == {str(worker)}
    # the predicted rows are the compiler's GPipe order: all forwards, then all backwards
    first = trace.summary["steps"][0]
    rank0 = [e["name"] for e in _spans(events, 2) if e["tid"] == 0 and e["args"]["step"] == first]
    rank0 = [n for n in rank0 if re.fullmatch(r"0[FB]\d+", n)]
    assert rank0 == [f"0F{m}" for m in range(MICROBATCHES)] + [f"0B{m}" for m in range(MICROBATCHES)]
    assert trace.summary["predicted_rows_for_steps"] == trace.summary["steps"]
    # each step's compute window, its first action to its last on any worker: within the step
    # (the step's time on the workers; its wall time from the client adds the call's way in and out)
    spans = [e for e in _spans(events, 1) if e["args"]["step"] == first]
    window_s = (max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)) / 1e6
    assert 0 < trace.summary["measured_step_window_s"] <= 2 * window_s


def test_every_send_has_an_arrow_to_its_receive(gpipe_run):
    _, _, _, trace, path = gpipe_run
    events = json.loads(path.read_text())["traceEvents"]
    spans = _spans(events, 1)
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert starts.keys() == ends.keys()

    def inside(flow, span):
        return flow["tid"] == span["tid"] and span["ts"] <= flow["ts"] <= span["ts"] + span["dur"]

    sends = [e for e in spans if e["cat"] == "send"]
    # 4-stage chain: stages 0-2 send forward, 1-3 send backward, per microbatch and step
    assert len(sends) == 2 * (STAGES - 1) * MICROBATCHES * len(trace.summary["steps"])
    arrows_of = {id(s): [f for f in starts.values() if inside(f, s)] for s in sends}
    for send in sends:
        stage, kind, mb = re.fullmatch(r"(\d+)(SEND_F|SEND_B)(\d+)", send["name"]).groups()
        stage, mb = int(stage), int(mb)
        peer, recv = (
            (stage + 1, f"{stage + 1}RECV_F{mb}") if kind == "SEND_F" else (stage - 1, f"{stage - 1}RECV_B{mb}")
        )
        (arrow,) = [f for f in arrows_of[id(send)] if f["name"] == f"{send['name']} -> {recv}"]
        end = ends[arrow["id"]]
        waits = [w for w in spans if w["name"] == f"wait {recv}" and w["args"]["step"] == send["args"]["step"]]
        assert len(waits) == 1 and waits[0]["tid"] == peer, (send, waits)
        assert inside(end, waits[0]), (send, end, waits[0])
    assert trace.summary["flows"] == len(sends) and trace.summary["unmatched_sends"] == []


def test_bubble_fractions_are_reported_for_every_worker(gpipe_run):
    """Each worker's bubble: measured, the plan's GPipe (p - 1) / (m + p - 1) (every stage's
    forward costing 1 and backward 2, the data plane free), and the plan's schedule simulated at
    the costs its actions had in the traced steps. How close the measured one comes is a figure of
    examples/trace_pipeline.py, not asserted here: it depends on what else the host runs."""
    _, _, _, trace, _ = gpipe_run
    planned = (STAGES - 1) / (MICROBATCHES + STAGES - 1)
    assert trace.summary["predicted_bubble_fraction"] == pytest.approx(planned)
    for w in trace.summary["workers"]:
        assert w["predicted_bubble"] == pytest.approx(planned)
        measured, at_costs = w["measured_bubble"], w["predicted_bubble_at_measured_costs"]
        assert 0 <= measured < 1 and 0 <= at_costs < 1, w
        assert trace.bubbles[w["worker"]] == (measured, w["predicted_bubble"])


def test_measured_bubble_is_within_5_points_of_the_prediction(gpipe_run):
    """Where the host gives every worker thread a CPU of its own, what the simulator does not model
    (contention for cores, wake-up latency) is small: the measured bubble is within 5 points of the
    simulation at the measured costs, and of the plan's own prediction. On a host with fewer CPUs
    (the 2-core CI machine: the trace flags it) an action's cost and a receive's wake-up vary from
    step to step with what else runs, and a fresh clone's CI run measured 8.4 points off."""
    _, _, _, trace, _ = gpipe_run
    if trace.summary["oversubscribed"]:
        pytest.skip(f"bubble prediction holds only with a CPU per worker thread: {trace.summary['note']}")
    planned = (STAGES - 1) / (MICROBATCHES + STAGES - 1)
    for w in trace.summary["workers"]:
        measured = w["measured_bubble"]
        assert abs(measured - w["predicted_bubble_at_measured_costs"]) <= 0.05, w
        assert abs(measured - planned) <= 0.05, w


def test_a_host_with_fewer_cpus_than_compute_threads_is_flagged(gpipe_run):
    """The trace says when the workers of one host run more compute threads than they have CPUs
    (as 4 one-thread workers on this 2-core CI machine do): there the prediction, which assumes a
    device per worker, is not what the measurement can be checked against."""
    cluster, _, _, trace, _ = gpipe_run
    threads = STAGES * cluster.threads_per_worker
    cpus = len(os.sched_getaffinity(0))
    crowded = trace.summary["oversubscribed"]
    if threads > cpus:
        assert [(h["workers"], h["threads"], h["cpus"]) for h in crowded] == [(list(range(STAGES)), threads, cpus)]
        assert f"{threads} compute threads of workers" in trace.summary["note"]
    else:
        assert crowded == [] and trace.summary["note"] is None


def test_oversubscription_counts_the_cpus_a_hosts_workers_may_use():
    def worker(index, cpus, host="a", threads=1, device="cpu"):
        return trace.WorkerSteps(index, "", [], host=host, device=device, cpus=cpus, threads=threads)

    shared = [worker(i, [0, 1]) for i in range(4)]
    assert trace.oversubscribed(shared) == [{"host": "a", "workers": [0, 1, 2, 3], "threads": 4, "cpus": 2}]
    pinned = [worker(i, [i]) for i in range(4)]  # a CPU each (taskset): not crowded
    assert trace.oversubscribed(pinned) == []
    assert trace.oversubscribed([worker(0, [0], threads=2)]) == [{"host": "a", "workers": [0], "threads": 2, "cpus": 1}]
    two_hosts = [worker(0, [0, 1], host="a"), worker(1, [0, 1], host="b"), worker(2, [0], host="b", threads=2)]
    assert [h["host"] for h in trace.oversubscribed(two_hosts)] == ["b"]
    gpus = [worker(i, [0], device=f"cuda:{i}") for i in range(4)]  # GPU work does not wait for a CPU
    assert trace.oversubscribed(gpus) == [] and trace.oversubscription_note([]) is None


def test_actions_are_named_ranges_in_a_torch_profiler_trace(tmp_path):
    """A user profiling the process that runs a worker sees each action as ``atoll <action>``
    (here controller and worker run in this process, so one profiler sees the worker's threads)."""
    with in_process_cluster(tmp_path) as (controller, _, token_file):
        model, batches, loss = mlp()
        x, y = batches[0]
        with atoll.connect(controller.address, token_file=token_file) as client:
            job = client.pipeline(model, example_input=x, example_target=y, loss_fn=loss, stages=1, microbatches=2)
            every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=every_thread
            ) as profiler:
                job.step(x, y)
            job.close()
    names = {e.name for e in profiler.events() if e.name.startswith("atoll ")}
    assert names == {"atoll 0F0", "atoll 0F1", "atoll 0B0", "atoll 0B1", "atoll 0STEP"}


def test_atoll_trace_writes_the_json_and_a_png(gpipe_run, tmp_path, capsys):
    cluster, _, job, _, _ = gpipe_run
    out, png = tmp_path / "trace.json", tmp_path / "trace.png"
    args = ["trace", job.id, "-o", str(out), "--png", str(png), "--last", "2"]
    cli.main([*args, "--controller", cluster.address, "--token-file", str(cluster.log_dir / "token")])
    printed = json.loads(capsys.readouterr().out)
    assert printed["trace"] == str(out) and len(printed["steps"]) == 2
    rows = {e["tid"] for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X" and e["pid"] == 1}
    assert rows == set(range(STAGES))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def _replayed(compiled, step: int, drop: str = ""):
    """Spans a worker would record running ``compiled``'s action lists with the plan's own costs
    (F 1 s, B 2 s, the data plane free): each compute begins when the one before it ended and
    waits inside for its receive until the simulated start. ``drop`` leaves one span out."""
    routes, workers = compiled.routes, []
    for rank, actions in compiled.lowered.actions.items():
        simulated = {s.action: s for s in compiled.timeline.spans[rank]}
        clock, spans = 0.0, []
        for a in actions:
            if a.is_compute:
                start, end = simulated[a].start, simulated[a].end
                receives = routes.needs_recv_f(a.stage) if a.kind is Kind.FORWARD else routes.needs_recv_b(a.stage)
                if receives:
                    recv = Action(a.stage, Kind.RECV_F if a.kind is Kind.FORWARD else Kind.RECV_B, a.microbatch)
                    spans.append(pb.ActionSpan(name=f"wait {recv}", category="wait", start_s=clock, end_s=start))
                spans.append(pb.ActionSpan(name=str(a), category="compute", start_s=clock, end_s=end))
                clock = end
            else:
                category = {"SEND": "send", "RECV": "recv"}.get(a.kind.value[:4], "step")
                spans.append(pb.ActionSpan(name=str(a), category=category, start_s=clock, end_s=clock))
        spans = [s for s in spans if s.name != drop]
        workers.append(trace.WorkerSteps(rank, f"rank {rank}", [pb.StepTimeline(step=step, rank=rank, spans=spans)]))
    return workers


def test_a_run_at_the_plans_costs_measures_the_plans_bubble():
    """The trace's arithmetic on spans made to the plan's own costs: the measured bubble is the
    predicted one exactly, every send finds its receive, and a receive that never ran is named."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    compiled = compile_locally(model, x, y, F.mse_loss, stages=3, microbatches=4, schedule="1f1b")
    _, summary = trace.build(compiled, _replayed(compiled, step=1))
    planned = trace.simulated_bubbles(compiled.timeline)
    for w in summary["workers"]:
        assert w["measured_bubble"] == pytest.approx(planned[w["rank"]], abs=1e-9)
        assert w["predicted_bubble"] == pytest.approx(planned[w["rank"]])
        assert w["predicted_bubble_at_measured_costs"] == pytest.approx(planned[w["rank"]], abs=1e-9)
    sends = sum(a.kind.value.startswith("SEND") for acts in compiled.lowered.actions.values() for a in acts)
    assert summary["flows"] == sends and summary["unmatched_sends"] == []

    _, summary = trace.build(compiled, _replayed(compiled, step=2, drop="wait 1RECV_F2"))
    assert summary["unmatched_sends"] == ["step 2: worker 0 0SEND_F2 -> worker 1 1RECV_F2"]
