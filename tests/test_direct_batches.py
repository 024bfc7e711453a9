"""Batches posted by the client straight to the workers that read them: the controller checks
and orders the step but carries none of its rows (atoll.client.direct, runtime/worker/inbox.py)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import atoll
from atoll._rpc import atoll_pb2 as pb
from atoll._rpc import atoll_pb2_grpc as pb_grpc
from atoll.core.wire import tensor_to_pb
from atoll.net.rpc import Endpoint
from tests.reference import assert_matches_reference, train_reference

pytestmark = pytest.mark.cluster

ADAMW = {"lr": 1e-2}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)).double()


def _submit(client, model, x, y, direct: bool):
    job = client.pipeline(
        copy.deepcopy(model), example_input=x, example_target=y, loss_fn=F.mse_loss, stages=2, microbatches=2,
        data_parallel=2, optimizer="adamw", optimizer_args=ADAMW,
    )  # fmt: skip
    job.direct_batch_bytes = 0 if direct else None
    return job


def test_posted_batches_train_as_one_process(client4):
    model = _model()
    torch.manual_seed(1)
    batches = [(torch.randn(16, 16, dtype=torch.float64), torch.randn(16, 4, dtype=torch.float64)) for _ in range(4)]
    x, y = batches[0]
    job = _submit(client4, model, x, y, direct=True)
    try:
        losses = [job.step_async(*batches[0]).result()]
        losses += [f.result() for f in job.steps_async(batches[1:3])]  # several steps in one call too
        losses.append(job.step(*batches[3]))
        memory = job.last.memory
        assert all(m["control_plane_tensor_bytes"] == 0 for m in memory.values())
        # each replica's readers got their rows: inputs on the first stage's workers, targets on the last's
        assert sum(m["posted_batch_bytes"] for m in memory.values()) == x.nbytes + y.nbytes
        assert all(m["posted_batch_bytes"] > 0 for m in memory.values())  # 2 stages x 2 replicas: all read
        ref_losses, ref_state = train_reference(model, batches, F.mse_loss, 2 * 2, "adamw", ADAMW)
        assert_matches_reference(losses, job.state_dict(), ref_losses, ref_state)
        ref = copy.deepcopy(model)
        ref.load_state_dict(ref_state)
        with torch.no_grad():  # forward and evaluate steps post their batches too
            assert torch.allclose(job.forward(x), ref(x), rtol=1e-9, atol=1e-12)
            assert job.evaluate(x, y) == pytest.approx(F.mse_loss(ref(x), y).item(), rel=1e-9)
        assert job.last.memory[0]["control_plane_tensor_bytes"] == 0
    finally:
        job.close()


def test_the_benchmark_trains_alike_both_ways_at_its_smallest_size(cluster4):
    """bench/direct_batches.py on the shared cluster: the same losses posted and through the
    controller, and only the latter carries the batch's bytes there."""
    from bench import direct_batches

    row = direct_batches.compare(cluster4, sizes_kib=[64], steps=2, rounds=1)["64KiB"]
    assert row["same_losses"] and row["ratio_posted_vs_through"] > 0
    assert row["posted"]["control_plane_tensor_bytes"] == 0
    assert row["through_controller"]["control_plane_tensor_bytes"] == row["batch_bytes"]


def test_bad_posts_and_steps_are_refused_and_the_job_keeps_serving(client4):
    model = _model()
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    job = _submit(client4, model, x, y, direct=True)
    route = client4._call("BatchRoute", pb.JobRef(job_id=job.id)).readers
    worker, last = (Endpoint(r.address, client4._token, pb_grpc.WorkerStub, 10.0) for r in (route[0], route[-1]))
    try:
        assert {(r.replica, r.inputs, r.targets) for r in route} == {(0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1)}
        with pytest.raises(atoll.NotFound, match="job 'nope' is not loaded on this worker"):
            worker.call("PostBatch", pb.PostBatchRequest(job_id="nope", step=1, inputs=[tensor_to_pb(x)]))
        with pytest.raises(atoll.InvalidInput, match="does not read the batch's inputs"):  # the last stage's
            last.call("PostBatch", pb.PostBatchRequest(job_id=job.id, step=1, inputs=[tensor_to_pb(x)]))
        short = pb.TensorData(dtype="float64", shape=[4, 16], data=b"\0" * 8)
        with pytest.raises(atoll.InvalidInput, match="bytes"):
            worker.call("PostBatch", pb.PostBatchRequest(job_id=job.id, step=1, inputs=[short]))
        # a step marked as posted may not carry bytes through the controller as well
        sneaked = pb.StepRequest(job_id=job.id, inputs=[tensor_to_pb(x)], targets=[tensor_to_pb(y)], direct=True)
        with pytest.raises(atoll.InvalidInput, match="carries no bytes"):
            client4._call("Step", sneaked)
        job._next_seq += 1  # that refused step used up its number
        assert job.step(x, y) > 0  # the job keeps serving, its batch posted
        assert job.last.memory[0]["control_plane_tensor_bytes"] == 0
    finally:
        worker.close()
        last.close()
        job.close()
