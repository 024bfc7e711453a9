"""MPMD programs on islands: different modules on different groups of workers, fan-out and fan-in,
against the single-process run of the same program (tests.reference.RTOL = 1e-5 relative)."""

import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import atoll
from tests.reference import assert_matches_reference, train_reference

ADAMW = {"lr": 1e-3, "weight_decay": 0.01}


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(48, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, a, b):
        return self.out(torch.relu(self.mix(torch.cat([a, b], dim=-1))))


def _two_towers(head_island: str = "c", head_workers: int = 1):
    """Two different encoders read the same input (fan-out); a head reads both (fan-in). With
    ``head_workers=2`` the head is itself a pipeline of two workers, cut where ``out`` starts."""
    torch.manual_seed(0)
    tower_a = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32))
    tower_b = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.LayerNorm(16))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 12, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(4)]
    prog = atoll.Program()
    x, y = prog.input("x", batches[0][0]), prog.input("y", batches[0][1])
    a = prog.stage(tower_a, x, island="a", name="tower_a")
    b = prog.stage(tower_b, x, island="b", name="tower_b")
    split = ["out"] if head_workers > 1 else None
    out = prog.stage(_Head(), a, b, island=head_island, name="head", stages=head_workers, split_points=split)
    prog.loss(F.cross_entropy, out, y)
    return prog, batches


@pytest.fixture(scope="module")
def islands_cluster():
    with atoll.LocalCluster(workers=4, islands=["a", "b", "c", "c"]) as cluster:
        yield cluster


def test_two_towers_on_three_islands_match_single_process(islands_cluster):
    prog, batches = _two_towers()
    reference_model = prog.module()
    with islands_cluster.client() as client:
        job = client.compile(prog, microbatches=4, schedule="1f1b", optimizer="adamw", optimizer_args=ADAMW)
        try:
            losses = [job.step(x, y) for x, y in batches]
            state = job.state_dict()
            output = job.forward(batches[0][0])
            island_of = {w.worker_id: w.island for w in client.status().workers}
        finally:
            job.close()
    report = job.plan.report
    placed = [island_of[report["placement"][str(r)].split()[0]] for r in range(3)]
    assert placed == ["a", "b", "c"]
    flow = {(e["from_stage"], e["to_stage"]) for e in report["dataflow"]}
    assert flow == {("input", 0), ("input", 1), (0, 2), (1, 2)}  # fan-out of x, fan-in at the head
    # the towers do not wait for each other: both start at time 0 in the predicted timeline
    assert report["grid"][0][0] == "0F0" and report["grid"][1][0] == "1F0"
    ref_losses, ref_state = train_reference(reference_model, batches, F.cross_entropy, 4, "adamw", ADAMW)
    assert_matches_reference(losses, state, ref_losses, ref_state)
    trained = prog.module()
    trained.load_state_dict(state)
    with torch.no_grad():
        expected = trained(batches[0][0])
    assert torch.allclose(output, expected, rtol=1e-5, atol=1e-6)


def test_a_stage_that_is_itself_a_pipeline_matches_single_process(islands_cluster):
    """The head runs as a pipeline of two workers of island c, cut where its ``out`` starts."""
    prog, batches = _two_towers(head_workers=2)
    reference_model = prog.module()
    with islands_cluster.client() as client:
        job = client.compile(prog, microbatches=2, schedule="1f1b")
        try:
            losses = [job.step(x, y) for x, y in batches]
            state = job.state_dict()
        finally:
            job.close()
    report = job.plan.report
    assert [s["modules"][0] for s in report["stages"]] == [
        "stages.tower_a",
        "stages.tower_b",
        "stages.head",
        "stages.head.out",
    ]
    assert {(e["from_stage"], e["to_stage"]) for e in report["dataflow"]} >= {(0, 2), (1, 2), (2, 3)}
    ref_losses, ref_state = train_reference(reference_model, batches, F.cross_entropy, 2, "sgd", {})
    assert_matches_reference(losses, state, ref_losses, ref_state)
    bad = atoll.Program()
    x, y = bad.input("x", batches[0][0]), bad.input("y", batches[0][1])
    out = bad.stage(_Head(), bad.stage(nn.Linear(12, 32), x), bad.stage(nn.Linear(12, 16), x), stages=2)
    bad.loss(F.cross_entropy, out, y)
    with pytest.raises(atoll.InvalidInput, match="stage 's2' runs on 2 workers: give its 1 split_points"):
        bad.split_at()


def test_island_requests_that_cannot_be_met_are_refused_whole(islands_cluster):
    prog, _ = _two_towers(head_island="z")
    with islands_cluster.client() as client:
        with pytest.raises(
            atoll.NotEnoughWorkers, match=r"1 on a, 1 on b, 1 on z\) but the live ones are: 1 on a, 1 on b, 2 on c"
        ):
            client.compile(prog, microbatches=4)
        with pytest.raises(atoll.InvalidInput, match="a program decides stages itself"):
            client.compile(prog, microbatches=4, stages=2)
        busy = {len(w.jobs) for w in client.status().workers}
    assert busy == {0}  # nothing was half-allocated


def test_admission_queue_grants_in_order_when_workers_are_released(islands_cluster):
    """An exclusive job holds 3 of the 4 workers; a second exclusive request for 3 waits in the
    queue (visible in status) and is granted when the first job closes. A request larger than
    the cluster fails after its deadline, naming what it asked for."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    x = torch.randn(4, 4)
    args = dict(example_input=x, example_target=x, loss_fn=F.mse_loss, stages=3, microbatches=2, exclusive=True)
    with islands_cluster.client() as client, islands_cluster.client() as other:
        first = client.pipeline(model, name="first", **args)
        granted = []
        waiter = threading.Thread(
            target=lambda: granted.append(other.pipeline(model, name="second", admission_timeout_s=120, **args))
        )
        waiter.start()
        deadline = time.monotonic() + 60
        while not client.status().queue and time.monotonic() < deadline:
            time.sleep(0.05)
        status = client.status()
        assert [(q.name, q.ranks, q.exclusive) for q in status.queue] == [("second", 3, True)]
        assert "admission queue (1):\n  1. second needs 3 cpu workers exclusive" in status.render()
        assert not granted
        first.close()
        waiter.join(timeout=120)
        assert not waiter.is_alive() and len(granted) == 1
        second = granted[0]
        assert second.step(x, x) > 0
        assert not client.status().queue
        with pytest.raises(
            atoll.NotEnoughWorkers, match=r"needs 3 idle workers .* \(waited 0.5s in the admission queue"
        ):
            client.pipeline(model, name="third", admission_timeout_s=0.5, **args)  # only 1 idle worker left
        second.close()
        with pytest.raises(atoll.NotEnoughWorkers, match=r"needs 5 workers .* \(waited 0.5s in the admission queue\)"):
            client.pipeline(nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)]), name="too big",
                            admission_timeout_s=0.5, **{**args, "stages": 5})  # fmt: skip
