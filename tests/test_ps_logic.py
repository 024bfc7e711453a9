"""Parameter-server logic without processes: key layout, the servers' update rules, and a shard's
consistency, ordering and copy (runtime/core/ps_layout.py, runtime/worker/ps/), and a job's row in the
controller's state directory (controller/statedir.py)."""

import dataclasses
import socket
import threading
import time

import pytest
import torch

from atoll._rpc import atoll_pb2 as pb
from atoll.controller.statedir import PsJobRow, StateDir
from atoll.core import ps_layout
from atoll.core.ps_rules import Consistency, UpdateRule
from atoll.errors import DeadlineExceeded, InvalidInput, NotFound, WorkerUnavailable
from atoll.net.shard_peers import ShardPeers
from atoll.worker.ps.optim import KeyState
from atoll.worker.ps.shard import Push, ShardReplica


def test_consistent_hashing_moves_only_the_keys_of_a_new_server():
    names = [f"layer{i}.weight" for i in range(400)]
    before = ps_layout.Ring(4)
    after = ps_layout.Ring(5)
    moved = [n for n in names if before.owner(n) != after.owner(n)]
    assert all(after.owner(n) == 4 for n in moved)  # a key moves only to the new server
    assert 0.1 < len(moved) / len(names) < 0.32  # about 1/5 of them
    counts = [sum(before.owner(n) == s for n in names) for s in range(4)]
    assert min(counts) > 50  # every server holds a fair part


def test_tables_split_into_row_ranges_and_chains_follow_the_ring():
    keys = ps_layout.split_keys({"emb": (250, 4), "w": (3, 3), "b": ()}, {"emb"}, servers=3, rows_per_key=100)
    assert [(k.key, k.rows, k.sparse) for k in keys] == [
        ("emb[0:100]", 100, True), ("emb[100:200]", 100, True), ("emb[200:250]", 50, True),
        ("w", 3, False), ("b", 1, False),
    ]  # fmt: skip
    assert {k.shard for k in keys} <= {0, 1, 2}
    assert ps_layout.chains(3, 2) == [[0, 1], [1, 2], [2, 0]]
    with pytest.raises(InvalidInput, match="replication"):
        ps_layout.chains(2, 3)
    with pytest.raises(InvalidInput, match="not parameters"):
        ps_layout.split_keys({"w": (3,)}, {"emb"}, 2, 10)


def test_predicted_bytes_count_touched_rows_both_ways():
    keys = ps_layout.split_keys({"emb": (1000, 8), "w": (4, 8)}, {"emb"}, 2, 300)
    pulled, pushed = ps_layout.step_bytes(keys, {"emb": 32, "w": 32}, {"emb": [1, 2, 700]})
    assert pulled == pushed == 3 * (32 + 8) + 128


def test_adamw_on_a_whole_key_is_torch_adamw():
    torch.manual_seed(0)
    w = torch.randn(5, 3, dtype=torch.float64)
    ref = torch.nn.Parameter(w.clone())
    opt = torch.optim.AdamW([ref], lr=0.01, weight_decay=0.1)
    key = KeyState(w.clone(), UpdateRule("adamw", 0.01, 0.1))
    for _ in range(4):
        g = torch.randn(5, 3, dtype=torch.float64)
        ref.grad = g.clone()
        opt.step()
        key.apply(g)
    torch.testing.assert_close(key.value, ref.detach(), rtol=1e-12, atol=1e-12)


def test_adamw_on_rows_is_lazy_and_counts_steps_per_row():
    torch.manual_seed(0)
    w = torch.randn(6, 2, dtype=torch.float64)
    rows = torch.tensor([1, 4])
    key = KeyState(w.clone(), UpdateRule("adamw", 0.01, 0.1))
    g = torch.randn(2, 2, dtype=torch.float64)
    key.apply(g, rows)
    untouched = torch.tensor([0, 2, 3, 5])
    assert torch.equal(key.value[untouched], w[untouched])  # untouched rows do not decay or move
    ref = torch.nn.Parameter(w[rows].clone())
    opt = torch.optim.AdamW([ref], lr=0.01, weight_decay=0.1)
    ref.grad = g.clone()
    opt.step()
    torch.testing.assert_close(key.value[rows], ref.detach(), rtol=1e-12, atol=1e-12)
    assert key.state["steps"].tolist() == [0, 1, 0, 0, 1, 0]


def _replica(mode: str, tasks: int = 2, max_delay: int = 0, timeout: float = 5.0) -> ShardReplica:
    keys = ps_layout.split_keys({"w": (2,), "emb": (4, 1)}, {"emb"}, 1, 100)
    values = {"w": torch.zeros(2, dtype=torch.float64), "emb": torch.zeros(4, 1, dtype=torch.float64)}
    return ShardReplica(keys, values, UpdateRule("sgd", 1.0), Consistency(mode, max_delay, timeout), tasks)


def _push(g: float, rows=(1,)) -> Push:
    r = torch.tensor(rows)
    return Push(
        {"w": torch.full((2,), g, dtype=torch.float64)},
        {"emb": (r, torch.full((len(rows), 1), g, dtype=torch.float64))},
    )


def test_sequential_applies_the_mean_once_every_task_pushed():
    shard = _replica("sequential")
    assert shard.push(0, 0, _push(1.0))
    values, clock, _, _ = shard.pull(0, 0, ["w"], [], no_wait=False)
    assert values[0].tolist() == [0.0, 0.0] and clock == [0, 0]  # held: task 1 has not pushed
    assert shard.push(1, 0, _push(3.0, rows=(1, 2)))
    values, clock, staleness, _ = shard.pull(0, 1, ["w"], [("emb", torch.tensor([1, 2]))], no_wait=False)
    assert values[0].tolist() == [-2.0, -2.0] and clock == [1, 1] and staleness == 0
    assert values[1].flatten().tolist() == [-2.0, -1.5]  # row 1: (1 + 3) / 2, row 2: 3 / 2
    assert not shard.push(1, 0, _push(9.0))  # sent again (failover): acknowledged, not applied
    with pytest.raises(InvalidInput, match="before"):
        shard.push(0, 2, _push(1.0))


def test_bounded_pull_waits_for_the_slowest_and_reports_staleness():
    shard = _replica("bounded", max_delay=1, timeout=0.5)
    for i in range(2):
        shard.push(0, i, _push(1.0))
    _, clock, staleness, _ = shard.pull(0, 1, ["w"], [], no_wait=False)
    assert clock == [2, 0] and staleness == 1  # at the bound, served
    with pytest.raises(DeadlineExceeded, match="slower tasks"):
        shard.pull(0, 2, ["w"], [], no_wait=False)  # would be 2 behind
    threading.Timer(0.1, lambda: shard.push(1, 0, _push(1.0))).start()
    started = time.monotonic()
    _, clock, staleness, waited = shard.pull(0, 2, ["w"], [], no_wait=False)
    assert clock == [2, 1] and staleness == 1 and waited >= 0.05 and time.monotonic() - started < 0.5


def test_eventual_never_waits_and_a_dropped_task_is_not_waited_for():
    shard = _replica("eventual")
    _, _, staleness, waited = shard.pull(0, 50, ["w"], [], no_wait=False)
    assert staleness == 50 and waited < 0.1
    seq = _replica("sequential")
    seq.push(0, 0, _push(2.0))
    seq.drop(1)  # task 1 died: the iteration completes with task 0's push alone
    values, clock, _, _ = seq.pull(0, 1, ["w"], [], no_wait=False)
    assert values[0].tolist() == [-2.0, -2.0] and clock == [1, 0]
    with pytest.raises(InvalidInput, match="dropped"):
        seq.push(1, 0, _push(1.0))


def test_bad_pushes_and_pulls_are_refused_before_anything_changes():
    shard = _replica("eventual")
    with pytest.raises(InvalidInput, match=r"gradient \[3\]"):
        shard.check(0, Push({"w": torch.zeros(3, dtype=torch.float64)}, {}))
    with pytest.raises(InvalidInput, match="lie in"):
        shard.check(0, Push({}, {"emb": (torch.tensor([9]), torch.zeros(1, 1, dtype=torch.float64))}))
    with pytest.raises(InvalidInput, match="out of range"):
        shard.check(5, _push(1.0))
    with pytest.raises(NotFound, match="not held"):
        shard.pull(0, 0, ["nope"], [], no_wait=True)
    values, clock, _, _ = shard.pull(0, 0, ["w"], [], no_wait=True)
    assert values[0].tolist() == [0.0, 0.0] and clock == [0, 0]


def test_a_copy_of_a_replica_carries_values_optimizer_state_clock_and_held_pushes():
    keys = ps_layout.split_keys({"w": (2,)}, set(), 1, 100)
    rule = UpdateRule("adamw", 0.1)
    a = ShardReplica(keys, {"w": torch.ones(2)}, rule, Consistency("sequential"), 2)
    a.push(0, 0, Push({"w": torch.ones(2)}, {}))
    a.push(1, 0, Push({"w": torch.ones(2)}, {}))
    a.push(0, 1, Push({"w": torch.full((2,), 2.0)}, {}))  # held: task 1 has not pushed iteration 1
    b = ShardReplica(keys, {"w": torch.zeros(2)}, rule, Consistency("sequential"), 2)
    b.restore(*a.export())
    for r in (a, b):
        r.push(1, 1, Push({"w": torch.full((2,), 4.0)}, {}))
    assert torch.equal(a.state["w"].value, b.state["w"].value) and a.clock == b.clock == [2, 2]


def test_the_graph_a_task_gets_carries_no_weights_and_names_the_tables_read_only_by_lookups():
    import torch.nn.functional as F

    from atoll.client.parameter_server import export_training
    from tests.ps_cases import Recommender

    model = Recommender(rows=1_000_000, dim=16)
    ids, y = torch.randint(0, 1_000_000, (4, 3)), torch.randint(0, 4, (4,))
    graph, values, sparse = export_training(model, ids, y, F.cross_entropy)
    assert len(graph) < 100_000  # the 64 MB table is not in it: the servers hold the values
    assert torch.equal(values["model.table.weight"], model.table.weight.detach())
    assert sparse == ["model.table.weight"]

    class TiedLM(torch.nn.Module):  # the table is also the output layer: not a lookup-only table
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 8)

        def forward(self, idx):
            return self.emb(idx).mean(1) @ self.emb.weight.T

    _, _, sparse = export_training(TiedLM(), torch.randint(0, 50, (4, 3)), torch.randint(0, 50, (4,)), F.cross_entropy)
    assert sparse == []


def test_a_state_directory_keeps_a_parameter_server_job_until_it_is_closed(tmp_path):
    row = PsJobRow(
        job_id="ps1-abc123",
        session="s",
        config=b"\x08\x01",
        servers=("w1", "w2"),
        tasks=("w3",),
        chains=((0, 1), (1,)),
        dropped=(0,),
    )
    records = StateDir(tmp_path)
    records.ps_job(row)
    records.ps_job(dataclasses.replace(row, chains=((1,), (1,))))  # a repair rewrites it
    records.close()
    records = StateDir(tmp_path)  # as a restarted controller reads it
    assert records.read().ps_jobs == (dataclasses.replace(row, chains=((1,), (1,))),)
    records.ps_job_closed(row.job_id)
    assert records.read().ps_jobs == ()
    records.close()


def _closed_port_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed


def test_a_member_that_does_not_answer_is_not_passed_over():
    """Chain membership is the controller's: a push whose next member does not answer is not
    acknowledged, and a task's call waits (``failover_s``) for the chain to change rather than
    skipping the member, whose replica would then miss updates and could later serve without them."""
    peers = ShardPeers([_closed_port_address(), _closed_port_address()], [[0, 1]], "token", 5.0, failover_s=0.3)
    with pytest.raises(WorkerUnavailable, match="server 1, next after server 0 in its chain, does not answer"):
        peers.pass_down(0, 0, "Push", pb.PsPushRequest(job_id="ps1-abcdef", shard=0))
    started = time.monotonic()
    with pytest.raises(WorkerUnavailable, match=r"its head, server 0, does not answer.*within 0.3s"):
        peers.call(0, "Pull", pb.PsPullRequest(job_id="ps1-abcdef", shard=0))
    assert 0.05 <= time.monotonic() - started < 5.0  # it tried again before giving up
    assert peers.chain(0) == [0, 1]  # nobody was taken out but by the controller
    peers.reconfigure([[1]])
    with pytest.raises(WorkerUnavailable, match="server 1"):
        peers.call(0, "Pull", pb.PsPullRequest(job_id="ps1-abcdef", shard=0))
