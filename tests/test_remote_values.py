"""Remote values: a forward step's output stays on its worker and feeds another job's training
step worker to worker; neither the client nor the controller carries its bytes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import atoll
from tests.reference import assert_matches_reference, train_reference

pytestmark = pytest.mark.cluster  # every test here starts processes

SGD = {"lr": 0.1}


def test_a_kept_output_trains_another_job_without_passing_through_client_or_controller(client4):
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    head = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x, y = torch.randn(16, 8), torch.randn(16, 2)
    enc = client4.pipeline(encoder, example_input=x, example_target=x, loss_fn=F.mse_loss, stages=2, microbatches=2)
    features = enc.forward(x, keep=True)
    assert isinstance(features, atoll.RemoteValue) and features.shape == (16, 8)
    target = client4.put(y)
    job = client4.pipeline(head, example_input=x, example_target=y, loss_fn=F.mse_loss, stages=2, microbatches=2,
                           optimizer_args=SGD)  # fmt: skip
    try:
        holder = enc.plan.report["placement"][str(1)].split()[0]
        consumer = job.plan.report["placement"][str(0)].split()[0]
        assert features.worker_id == holder != consumer  # the value has to travel
        # one step alone, two sent together (Job.steps_async): each pulls the value from its holder
        futures = [job.step_async(features, target), *job.steps_async([(features, target)] * 2)]
        losses = [f.result() for f in futures]
        memory = job.last.memory
        assert job.last.step == 3
        assert all(m["control_plane_tensor_bytes"] == 0 for m in memory.values())
        assert memory[0]["data_plane_bytes"]["received"] >= 16 * 8 * 4  # pulled from the holder
        expected_features = enc.forward(x)
        assert torch.allclose(features.result(), expected_features)
        ref_losses, ref_state = train_reference(head, [(expected_features, y)] * 3, F.mse_loss, 2, "sgd", SGD)
        assert_matches_reference(losses, job.state_dict(), ref_losses, ref_state)
        features.free()
        with pytest.raises(atoll.InvalidInput, match="was freed"):
            job.step(features, target)
        assert job.step(expected_features, y) > 0  # the job keeps serving
    finally:
        job.close()
        enc.close()
        target.free()


def test_put_checks_specs_and_islands(client4):
    value = client4.put(torch.randn(4, 3))
    head = nn.Linear(8, 2)
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    job = client4.pipeline(head, example_input=x, example_target=y, loss_fn=F.mse_loss, stages=1, microbatches=1)
    try:
        with pytest.raises(atoll.InvalidInput, match=r"expected .*float32\[4, 8\].* remote values are float32\[4, 3\]"):
            job.step(value, y)
        assert job.step(x, y) > 0  # the job keeps serving
        with pytest.raises(atoll.NotEnoughWorkers, match="no live worker on island 'mars'"):
            client4.put(x, island="mars")
    finally:
        job.close()
        value.free()
        value.free()  # idempotent
