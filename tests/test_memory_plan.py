"""Predicted memory against the workers' own accounting, on the GPT example."""

import pytest

from examples.gpt import lm_loss
from tests import models

pytestmark = pytest.mark.cluster  # every test here starts processes

RANKS, MICROBATCHES = 4, 8


@pytest.fixture(scope="module")
def gpt():
    return models.char_gpt(layers=6, steps=3)


def train(client, gpt, schedule, rematerialize=False):
    model, batches = gpt
    x, y = batches[0]
    virtual = 2 if schedule == "interleaved_1f1b" else 1
    job = client.pipeline(
        model,
        example_input=x,
        example_target=y,
        loss_fn=lm_loss,
        stages=RANKS,
        microbatches=MICROBATCHES,
        schedule=schedule,
        virtual_stages=virtual,
        rematerialize=rematerialize,
        optimizer="adamw",
        optimizer_args={"lr": 1e-3},
    )
    try:
        for x, y in batches:  # from the second step on, the optimizer state exists throughout
            job.step(x, y)
        return job.plan, job.last.memory
    finally:
        job.close()


@pytest.mark.parametrize(
    ("schedule", "rematerialize"), [("gpipe", False), ("1f1b", False), ("interleaved_1f1b", False), ("1f1b", True)]
)
def test_predicted_peak_within_ten_percent_of_measured(client4, gpt, schedule, rematerialize):
    plan, measured = train(client4, gpt, schedule, rematerialize)
    for rank in range(RANKS):
        predicted = plan.predicted_memory[rank]["total"]
        actual = measured[rank]["peak"]["total"]
        assert abs(predicted - actual) <= 0.10 * actual, f"rank {rank}: predicted {predicted}, measured {actual}"
        assert plan.predicted_memory[rank]["peak_stashed_microbatches"] == measured[rank]["peak_stashed_microbatches"]


def test_1f1b_stashes_fewer_microbatches_than_gpipe(client4, gpt):
    _, gpipe = train(client4, gpt, "gpipe")
    _, one_f_one_b = train(client4, gpt, "1f1b")
    for rank in range(RANKS):
        assert gpipe[rank]["peak_stashed_microbatches"] == MICROBATCHES
        assert one_f_one_b[rank]["peak_stashed_microbatches"] == min(RANKS - rank, MICROBATCHES)
        assert one_f_one_b[rank]["peak"]["activations"] < gpipe[rank]["peak"]["activations"]


def test_rematerialization_shrinks_stashed_activations(client4, gpt):
    plan, stash = train(client4, gpt, "gpipe")
    remat_plan, remat = train(client4, gpt, "gpipe", rematerialize=True)
    for rank in range(RANKS):
        assert remat[rank]["peak"]["activations"] < stash[rank]["peak"]["activations"] / 2
    for a, b in zip(plan.report["stages"], remat_plan.report["stages"]):
        assert b["stashed_bytes_per_microbatch"] < a["stashed_bytes_per_microbatch"]
        assert b["recomputed_bytes_per_microbatch"] > 0


def test_a_loss_kernel_that_keeps_its_elementwise_buffer_is_predicted_exactly(client4):
    """torch's CPU ``mse_loss`` returns the 0-dim loss on the storage of its whole elementwise
    buffer; the fake kernel the plan is made with allocates the scalar alone. The worker stashes
    the loss on a storage of its own (runtime/worker/executor/compute.py), so the plan holds."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    x, y = torch.randn(256, 64), torch.randn(256, 16)
    assert F.mse_loss(x[:32, :16], y[:32]).untyped_storage().nbytes() == 32 * 16 * 4  # the kernel's quirk
    job = client4.pipeline(
        model, example_input=x, example_target=y, loss_fn=F.mse_loss, stages=2, microbatches=8,
        optimizer="sgd", optimizer_args={"lr": 0.01},
    )  # fmt: skip
    try:
        measured = job.step_async(x, y).details().memory
    finally:
        job.close()
    for rank in range(2):
        assert measured[rank]["peak"] == {k: job.plan.predicted_memory[rank][k] for k in measured[rank]["peak"]}
