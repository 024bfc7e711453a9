"""Data parallelism: D replicas of a pipeline, each on its own workers and 1/D of each batch, with
gradients averaged before every optimizer step, against one process running all D x M
microbatches (tests.reference.RTOL = 1e-5 relative)."""

import pytest
import torch
import torch.nn.functional as F

import atoll
from atoll.core import linear_grads
from tests import models
from tests.reference import assert_losses_match, assert_matches_reference, train_reference
from tests.test_pipeline_parity import run_pipeline

pytestmark = pytest.mark.cluster  # every test here starts processes

OPTIMIZERS = {"sgd": {"lr": 0.05, "momentum": 0.9}, "adamw": {"lr": 1e-3, "weight_decay": 0.01}}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize(
    "make_model, stages, zero, transport",
    [
        (models.mlp, 1, 0, "auto"),
        (models.mlp, 2, 0, "auto"),
        (models.transformer, 1, 0, "auto"),
        (models.transformer, 1, 0, "gloo"),
        (models.transformer, 1, 1, "auto"),
        (models.transformer, 2, 0, "auto"),
        (models.mlp, 2, 1, "auto"),
        (models.transformer, 2, 1, "auto"),
    ],
    ids=[
        "dp2",
        "pp2xdp2",
        "gpt-dp2",
        "gpt-dp2-gloo",
        "gpt-dp2-zero1",
        "gpt-pp2xdp2",
        "pp2xdp2-zero1",
        "gpt-pp2xdp2-zero1",
    ],
)
def test_data_parallel_replicas_match_single_process(client4, make_model, stages, zero, transport, optimizer):
    model, batches, loss_fn = make_model()
    x, y = batches[0]
    args = OPTIMIZERS[optimizer]
    job = client4.pipeline(
        model,
        example_input=x,
        example_target=y,
        loss_fn=loss_fn,
        stages=stages,
        microbatches=2,
        schedule="1f1b",
        optimizer=optimizer,
        optimizer_args=args,
        data_parallel=2,
        zero=zero,
        transport=transport,
    )
    try:
        results = [job.step_async(x, y).details() for x, y in batches]
        state = job.state_dict()
        output = job.forward(batches[0][0])
        workers = next(j for j in client4.status().jobs if j.job_id == job.id).workers
    finally:
        job.close()
    assert len(workers) == 2 * stages and len(set(workers)) == 2 * stages  # a worker per replica and rank
    assert job.plan.report["data_parallel"] == 2
    # CPU replicas average plain gradients over a socket ring; ZeRO's collectives and a forced gloo, gloo
    assert job.plan.report["replica_transport"] == ("gloo" if zero or transport == "gloo" else "socket")
    # each replica reports its 2 microbatches: 4 per step, in the batch's order
    ref_losses, ref_state = train_reference(model, batches, loss_fn, 4, optimizer, args)
    assert_matches_reference([r.loss for r in results], state, ref_losses, ref_state)
    predicted = job.plan.predicted_memory  # per pipeline rank, the same for every replica
    moved = job.plan.predicted_communication
    for r in results:
        assert len(r.microbatch_losses) == 4
        for w in range(2 * stages):
            assert r.memory[w]["data_plane_bytes"] == moved[w % stages]
            assert moved[w % stages]["all_reduced"] > 0
    for w in range(2 * stages):  # worker w runs rank w % stages of replica w // stages
        # from the second step on, when the optimizer state exists
        measured, expected = results[-1].memory[w]["peak"]["total"], predicted[w % stages]["total"]
        assert abs(measured - expected) <= 0.1 * expected, (w, measured, expected)
    reference = make_model()[0]
    reference.load_state_dict(state)
    with torch.no_grad():
        expected = reference(batches[0][0])
    assert torch.allclose(output, expected, rtol=1e-5, atol=1e-6)  # replica 0's rows, then replica 1's


@pytest.mark.parametrize("stages", [1, 2], ids=["dp2", "pp2xdp2"])
@pytest.mark.parametrize(("zero", "optimizer"), [(0, "sgd"), (1, "sgd"), (1, "adamw")])
def test_hugging_face_gpt2_on_two_replicas_matches_single_process(client4, stages, zero, optimizer):
    """GPT-2 from transformers, alone or on two stages with its embedding tied to the LM head
    across them: the tied gradients are summed within each replica, then averaged across
    replicas. With AdamW, the float32 run is held to its losses and a float64 run to its losses
    and weights (tests/reference.py, "AdamW parity")."""
    model, batches = models.hf_gpt2(pytest.importorskip("transformers"))
    args = OPTIMIZERS[optimizer]

    def run(model):
        x, y = batches[0]
        job = client4.pipeline(
            model, example_input=x, example_target=y, loss_fn=models.lm_loss, stages=stages, microbatches=2,
            schedule="1f1b", optimizer=optimizer, optimizer_args=args, data_parallel=2, zero=zero,
        )  # fmt: skip
        try:
            losses = [job.step(x, y) for x, y in batches]
            state = job.state_dict()
            moved = {w: m["data_plane_bytes"] for w, m in job.last.memory.items()}
            peaks = {w: m["peak"]["total"] for w, m in job.last.memory.items()}  # the optimizer state exists by now
        finally:
            job.close()
        tied = {"lm.transformer.wte.weight": [0, 1]} if stages == 2 else {}  # one stage holds both uses
        assert job.plan.report["tied_parameters"] == tied
        assert moved == {w: job.plan.predicted_communication[w % stages] for w in range(2 * stages)}
        for w, measured in peaks.items():
            expected = job.plan.predicted_memory[w % stages]["total"]
            assert abs(measured - expected) <= 0.1 * expected, (w, measured, expected)
        return losses, state

    losses, state = run(model)
    ref_losses, ref_state = train_reference(model, batches, models.lm_loss, 4, optimizer, args)
    if optimizer == "adamw":
        assert_losses_match(losses, ref_losses)
        model = model.double()
        losses, state = run(model)
        ref_losses, ref_state = train_reference(model, batches, models.lm_loss, 4, optimizer, args)
    assert_matches_reference(losses, state, ref_losses, ref_state)


def test_bad_data_parallel_layouts_are_refused_before_loading(client4):
    model, batches, loss_fn = models.mlp()
    x, y = batches[0]  # 32 rows
    args = dict(example_input=x, example_target=y, loss_fn=loss_fn)
    with pytest.raises(atoll.InvalidInput, match="data_parallel must be a positive integer, got 0"):
        client4.pipeline(model, stages=1, microbatches=2, data_parallel=0, **args)
    with pytest.raises(atoll.InvalidInput, match="not divisible into 64 microbatches"):
        client4.pipeline(model, stages=1, microbatches=32, data_parallel=2, **args)
    with pytest.raises(atoll.NotEnoughWorkers, match="needs 6 workers"):
        client4.pipeline(model, stages=3, microbatches=2, data_parallel=2, **args)
    for zero in (1, 2, 3):
        with pytest.raises(atoll.InvalidInput, match=f"zero={zero} shards .*: needs data_parallel > 1"):
            client4.pipeline(model, stages=2, microbatches=2, zero=zero, **args)
    with pytest.raises(atoll.InvalidInput, match="zero must be 0, 1, 2 or 3"):
        client4.pipeline(model, stages=1, microbatches=2, data_parallel=2, zero=4, **args)
    assert all(not w.jobs for w in client4.status().workers)


def _wide_mlp(width: int):
    """A chain whose every stage of two holds a ``width`` x ``width`` matrix (no batch norm: its
    running statistics are each replica's own, not the whole batch's)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, width), torch.nn.Tanh()]
    for _ in range(3):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 4))
    g = torch.Generator().manual_seed(1)
    return model, [(torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)) for _ in range(4)], F.mse_loss


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
@pytest.mark.parametrize("make", [_wide_mlp, models.tied_lm], ids=["mlp", "tied_lm"])
def test_in_place_linear_gradients_feed_the_replicas_buckets(client4, schedule, make):
    """At width 256 the matrices pass ``MIN_WEIGHT_ELEMENTS``: each replica adds those
    layers' weight gradients in place (atoll.core.linear_grads; in ZB-H1, in the weight halves)
    and hands each final one to its all-reduce buckets as autograd's hook would. Two replicas of
    a 2-rank pipeline, float64 AdamW against one process within 1e-5; every gradient reduced
    once (the bytes all-reduced equal the plan's), the tied embedding at ALL_REDUCE_GRAD."""
    assert 256 * 256 >= linear_grads.MIN_WEIGHT_ELEMENTS
    model, batches, loss_fn = models.in_float64(lambda: make(width=256))
    args = OPTIMIZERS["adamw"]
    job, losses, state = run_pipeline(
        client4, model, batches, loss_fn, stages=2, data_parallel=2, microbatches=2, schedule=schedule,
        optimizer="adamw", optimizer_args=args,
    )  # fmt: skip
    ref_losses, ref_state = train_reference(model, batches, loss_fn, 4, "adamw", args)
    assert_matches_reference(losses, state, ref_losses, ref_state)
    moved = job.plan.predicted_communication
    for w in range(4):
        assert job.last.memory[w]["data_plane_bytes"]["all_reduced"] == moved[w % 2]["all_reduced"] > 0
