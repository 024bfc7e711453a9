"""Job.evaluate and Job.forward: the plan's forward actions alone, against the single-process model."""

import copy

import pytest
import torch

from tests import models
from tests.reference import RTOL, relative_error, train_reference

pytestmark = pytest.mark.cluster  # every test here starts processes

SGD = {"lr": 0.05, "momentum": 0.9}


@pytest.mark.parametrize(
    ("make", "stages", "schedule", "virtual"),
    [
        (models.transformer, 4, "1f1b", 1),
        (models.mlp, 2, "interleaved_1f1b", 2),
        (models.mlp, 1, "interleaved_1f1b", 2),
    ],
    ids=["transformer-1f1b", "mlp-interleaved", "mlp-one-rank-interleaved"],
)
def test_evaluate_and_forward_match_the_single_process_model(client4, make, stages, schedule, virtual):
    job, model, batches, loss_fn = models.submit(
        client4,
        make,
        stages=stages,
        microbatches=4,
        schedule=schedule,
        virtual_stages=virtual,
        optimizer="sgd",
        optimizer_args=SGD,
    )
    try:
        for bx, by in batches[:2]:
            job.step(bx, by)
        before = job.state_dict()
        held_out_x, held_out_y = batches[-1]
        loss = job.evaluate(held_out_x, held_out_y)
        output = job.forward(held_out_x)
        after = job.state_dict()
        steps = [j.steps for j in client4.status().jobs if j.job_id == job.id][0]
    finally:
        job.close()

    _, ref_state = train_reference(model, batches[:2], loss_fn, 4, "sgd", SGD)
    trained = copy.deepcopy(model)
    trained.load_state_dict(ref_state)
    with torch.no_grad():
        chunks = zip(held_out_x.chunk(4), held_out_y.chunk(4))
        ref_loss = float(sum(loss_fn(trained(xm), ym) for xm, ym in chunks) / 4)
        ref_output = trained(held_out_x)

    assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), f"evaluate {loss} vs reference {ref_loss}"
    assert output.shape == ref_output.shape
    assert relative_error(output, ref_output) <= RTOL
    assert all(torch.equal(after[k], before[k]) for k in before), "evaluate/forward changed the weights"
    assert steps == 2  # only training steps count


def test_forward_refuses_a_target_and_evaluate_checks_it(client4):
    job, _, batches, _ = models.submit(client4, stages=2, microbatches=2)
    x, y = batches[0]
    try:
        with pytest.raises(Exception, match="edge 'target': expected float32\\[32, 4\\]"):
            job.evaluate(x, y[:, :2])
        assert job.forward(x).shape == (32, 4)  # the job keeps serving
    finally:
        job.close()
