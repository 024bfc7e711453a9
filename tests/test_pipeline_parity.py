"""Multi-process pipelines against a single-process reference: same init, same microbatching."""

import pytest

from tests import models
from tests.reference import assert_matches_reference, train_reference

pytestmark = pytest.mark.cluster  # every test here starts processes

OPTIMIZERS = {"sgd": {"lr": 0.05, "momentum": 0.9}, "adamw": {"lr": 1e-3, "weight_decay": 0.01}}


def run_pipeline(client, model, batches, loss_fn, **kwargs):
    x, y = batches[0]
    job = client.pipeline(model, example_input=x, example_target=y, loss_fn=loss_fn, **kwargs)
    try:
        losses = [job.step(x, y) for x, y in batches]
        return job, losses, job.state_dict()
    finally:
        job.close()


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("make_model", [models.mlp, models.transformer], ids=["mlp", "transformer"])
def test_four_stage_gpipe_matches_single_process(client4, make_model, optimizer):
    model, batches, loss_fn = make_model()
    args = OPTIMIZERS[optimizer]
    job, losses, state = run_pipeline(
        client4,
        model,
        batches,
        loss_fn,
        stages=4,
        microbatches=4,
        schedule="gpipe",
        optimizer=optimizer,
        optimizer_args=args,
    )
    assert len(job.plan.report["stages"]) == 4
    ref_losses, ref_state = train_reference(model, batches, loss_fn, 4, optimizer, args)
    assert_matches_reference(losses, state, ref_losses, ref_state)
    assert losses[-1] < losses[0]
