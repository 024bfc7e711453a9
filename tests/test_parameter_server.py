"""Parameter-server programs on real clusters: sequential consistency equals synchronous data
parallelism in one process, bounded delay holds its bound, eventual never waits, sparse rows move
only what a batch touches, bad input changes nothing, and deaths of servers and tasks."""

import math
import time

import pytest
import torch
import torch.nn.functional as F

import atoll
from atoll._rpc import atoll_pb2 as pb
from atoll._rpc import atoll_pb2_grpc as pb_grpc
from atoll.core.wire import tensor_to_pb
from atoll.errors import InvalidInput, NotFound
from atoll.net.rpc import Endpoint
from tests import ps_cases
from tests.reference import assert_losses_match, relative_error

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

RTOL = 1e-5


def _submit(client, model, example, **settings):
    x, y = example
    return client.parameter_server(model, example_input=x, example_target=y, loss_fn=F.cross_entropy, **settings)


def _run_rounds(job, rounds):
    """Every task fed its batch of each round, the tasks in parallel (job.run): per round, per task, its loss."""
    records = job.run([[r[t] for r in rounds] for t in range(job.tasks)])
    assert not job.errors and len(records) == len(rounds) * job.tasks
    losses = [[None] * job.tasks for _ in rounds]
    first = min(r.iteration for r in records)
    for r in records:
        losses[r.iteration - first][r.task] = r.loss
    return losses, records


def _assert_weights(job, ref_state, initial):
    """Every weight, and every weight's change from ``initial`` (the model before training: a
    few rows of a large table that went wrong would hide in the table's norm, not in its change)."""
    weights = job.weights()
    assert weights.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        assert weights[name].dtype == ref.dtype
        err = relative_error(weights[name], ref)
        assert err <= RTOL, f"{name}: relative error {err:.2e}"
        err = relative_error(weights[name] - initial[name], ref - initial[name])
        assert err <= RTOL, f"{name}: relative error of its update {err:.2e}"


@pytest.mark.parametrize(
    "case",
    ["dense-adamw", "sparse-sgd", "table-as-dense-adamw"],
)
def test_sequential_equals_synchronous_data_parallelism_in_one_process(client4, case):
    torch.manual_seed(0)
    if case == "dense-adamw":
        model, rounds, optimizer, wd = ps_cases.mlp().double(), ps_cases.dense_batches(5, 2), "adamw", 0.01
    else:  # SGD without weight decay: the rows a batch does not touch do not move, in both runs
        model, rounds = ps_cases.Recommender().double(), ps_cases.id_batches(5, 2, rows=1000)
        optimizer, wd = ("sgd", 0.0) if case == "sparse-sgd" else ("adamw", 0.01)
    ref_losses, ref_state = ps_cases.synchronous_reference(model, rounds, optimizer, 0.05, wd)
    with _submit(
        client4, model, rounds[0][0], servers=2, workers=2, optimizer=optimizer, lr=0.05, weight_decay=wd,
        rows_per_key=300, sparse=case != "table-as-dense-adamw",
    ) as job:  # fmt: skip
        assert any(k.sparse for k in job.keys) == (case == "sparse-sgd")
        listed = {j.job_id: j for j in client4.status().jobs}[job.job_id]
        assert listed.schedule == "parameter-server sequential" and len(listed.workers) == 4
        losses, records = _run_rounds(job, rounds)
        for got, ref in zip(losses, ref_losses):
            assert_losses_match(got, ref, RTOL)
        assert all(r.staleness == 0 for r in records)
        _assert_weights(job, ref_state, model.state_dict())


def _fed(job, steps: int, slow_task: int, delay_s: float):
    def feed(task):
        for x, y in (b[task] for b in ps_cases.dense_batches(steps, job.tasks, dtype=torch.float32, seed=task)):
            if task == slow_task:
                time.sleep(delay_s)
            yield x, y

    return [feed(t) for t in range(job.tasks)]


def test_bounded_delay_never_trains_staler_than_its_bound(client4):
    model = ps_cases.mlp()
    example = ps_cases.dense_batches(1, 1, dtype=torch.float32)[0][0]
    with _submit(client4, model, example, servers=2, workers=2, consistency="bounded", max_delay=1, lr=0.05) as job:
        records = job.run(_fed(job, 100, slow_task=1, delay_s=0.02))
        assert not job.errors and len(records) == 200
        assert max(r.staleness for r in records) == 1  # reached, never passed
        fast = [r for r in records if r.task == 0]
        assert sum(r.waited_s for r in fast) > 0.5  # the fast task was held back by the slow one


def test_eventual_never_waits(client4):
    model = ps_cases.mlp()
    example = ps_cases.dense_batches(1, 1, dtype=torch.float32)[0][0]
    with _submit(client4, model, example, servers=2, workers=2, consistency="eventual", lr=0.05) as job:
        records = job.run(_fed(job, 60, slow_task=1, delay_s=0.03))
        assert not job.errors and len(records) == 120
        fast = [r for r in records if r.task == 0]
        assert max(r.waited_s for r in records) < 0.05
        assert max(r.staleness for r in fast) > 5  # it ran ahead of the slow task, unheld


def test_sparse_rows_move_only_what_a_batch_touches(client4):
    rows, dim = 1_000_000, 16
    torch.manual_seed(0)
    model = ps_cases.Recommender(rows, dim)
    table_bytes = rows * dim * 4
    narrow = torch.randint(0, 50, (8, 5)), torch.randint(0, 4, (8,))  # at most 50 distinct rows
    wide = torch.randint(0, rows, (8, 5)), torch.randint(0, 4, (8,))  # 40 rows spread over every range
    with _submit(client4, model, narrow, servers=2, workers=1, optimizer="adamw", lr=0.01) as job:
        assert sum(k.sparse for k in job.keys) == 16  # the table in 16 ranges of 65,536 rows
        for x, y in (narrow, wide, narrow):
            record = job.step_task(0, x, y)
            assert (record.bytes_pulled, record.bytes_pushed) == job.predicted_step_bytes({"table.weight": x})
            assert record.bytes_pulled < table_bytes / 1000
        dense = sum(p.numel() * 4 for n, p in model.named_parameters() if n != "table.weight")
        for x in (narrow[0], wide[0]):
            pulled, _ = job.predicted_step_bytes({"table.weight": x})
            assert pulled == dense + x.unique().numel() * (dim * 4 + 8)  # rows touched, not the table
        weights = job.weights()
        moved = (weights["table.weight"] != model.table.weight.detach()).any(1)
        touched = torch.cat([narrow[0].flatten(), wide[0].flatten()]).unique()
        assert torch.equal(moved.nonzero().flatten(), touched)  # lazy AdamW: only the touched rows changed


def test_bad_input_gets_a_clear_error_and_changes_nothing(client4, cluster4):
    model = ps_cases.mlp()
    x, y = ps_cases.dense_batches(1, 1, dtype=torch.float32)[0][0]
    for settings, message in (
        ({"consistency": "strong"}, "consistency 'strong'"),
        ({"optimizer": "lamb"}, "optimizer 'lamb'"),
        ({"consistency": "bounded", "max_delay": -1}, "max_delay"),
        ({"replication": 3}, "replication must be between 1 and the number of servers"),
    ):
        with pytest.raises(InvalidInput, match=message):
            _submit(client4, model, (x, y), servers=2, workers=2, **settings)
    with pytest.raises(atoll.NotEnoughWorkers):
        _submit(client4, model, (x, y), servers=3, workers=2)
    with _submit(client4, model, (x, y), servers=2, workers=2, lr=0.05) as job:
        before = job.weights()
        key = job.keys[0]
        server = Endpoint(job.layout.servers[key.shard], cluster4.token, pb_grpc.ParameterServerStub, 10.0)
        wrong = pb.PsPushRequest(job_id=job.job_id, shard=key.shard, task=0, iteration=0)
        wrong.grads.add(name=key.key, tensor=tensor_to_pb(torch.zeros(3, 3)))
        with pytest.raises(InvalidInput, match=rf"push to '{key.key}': gradient \[3, 3\]"):
            server.call("Push", wrong)
        with pytest.raises(NotFound, match="'nope' is not held"):
            server.call("Pull", pb.PsPullRequest(job_id=job.job_id, shard=key.shard, keys=["nope"]))
        with pytest.raises(InvalidInput, match="task 7 is out of range"):
            server.call("Pull", pb.PsPullRequest(job_id=job.job_id, shard=key.shard, task=7, keys=[key.key]))
        with pytest.raises(NotFound, match="'ps999'"):
            server.call("Pull", pb.PsPullRequest(job_id="ps999", shard=key.shard, keys=[key.key]))
        with pytest.raises(InvalidInput, match="task 2 is out of range"):
            job.step_task(2, x, y)
        with pytest.raises(InvalidInput, match=r"tensor 0 is float32\[8, 3\], the job was built for float32\[8, 16\]"):
            job.step_task(0, x[:, :3], y)
        after = job.weights()
        assert all(torch.equal(before[n], after[n]) for n in before)  # nothing changed
        assert job.step_task(0, x, y).iteration == 0  # and the job still serves


def _wait_declared_dead(client, worker_id: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(w.worker_id == worker_id and w.alive for w in client.status().workers):
        assert time.monotonic() < deadline, f"{worker_id} was not declared dead in {timeout_s}s"
        time.sleep(0.2)


def test_a_dead_server_loses_no_acknowledged_update_and_is_replaced():
    """3 servers, replication 2: server 1 dies mid-run, then (its shards copied to the survivors)
    server 2: every shard still has a replica, and the final weights are the uninterrupted ones."""
    torch.manual_seed(0)
    model, rounds = ps_cases.Recommender().double(), ps_cases.id_batches(9, 2, rows=1000)
    ref_losses, ref_state = ps_cases.synchronous_reference(model, rounds, "sgd", 0.05)
    with atoll.LocalCluster(workers=5, heartbeat_timeout_s=2.0) as cluster, cluster.client() as client:
        job = _submit(client, model, rounds[0][0], servers=3, workers=2, replication=2, lr=0.05, rows_per_key=200)
        pids = {w.worker_id: w.pid for w in client.status().workers}
        index = {p.pid: i for i, p in enumerate(cluster.workers)}
        losses, _ = _run_rounds(job, rounds[:3])
        cluster.kill_worker(index[pids[job.server_worker_ids[1]]])
        more, _ = _run_rounds(job, rounds[3:6])  # served by the replicas at once
        _wait_declared_dead(client, job.server_worker_ids[1])
        time.sleep(1.0)  # the controller copies its shards when it declares it dead
        cluster.kill_worker(index[pids[job.server_worker_ids[2]]])
        last, _ = _run_rounds(job, rounds[6:])
        for got, ref in zip(losses + more + last, ref_losses):
            assert_losses_match(got, ref, RTOL)
        _assert_weights(job, ref_state, model.state_dict())
        job.close()


def test_a_dead_task_leaves_the_others_training():
    model = ps_cases.mlp()
    batches = ps_cases.dense_batches(30, 2, dtype=torch.float32)
    with atoll.LocalCluster(workers=3, heartbeat_timeout_s=2.0) as cluster, cluster.client() as client:
        job = _submit(client, model, batches[0][0], servers=1, workers=2, consistency="sequential", lr=0.05)
        pids = {w.worker_id: w.pid for w in client.status().workers}
        _run_rounds(job, batches[:3])
        cluster.kill_worker([p.pid for p in cluster.workers].index(pids[job.task_worker_ids[1]]))
        with pytest.raises(atoll.WorkerUnavailable):
            job.step_task(1, *batches[3][1])
        survivors = [job.step_task(0, *b[0]) for b in batches[3:]]  # waits for task 1 until it is dropped
        assert [r.iteration for r in survivors] == list(range(3, 30))
        # the survivor's updates go on being applied: each of its steps reads a newer version (its
        # labels are random, so its loss stays level: "the last loss below the first" was a coin toss)
        versions = [r.versions[0] for r in survivors]
        assert all(b > a for a, b in zip(versions, versions[1:])), versions
        assert all(math.isfinite(r.loss) for r in survivors)
        job.close()
