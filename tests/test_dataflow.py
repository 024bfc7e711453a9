"""Whole-model compile: models that are not a chain of blocks, against the single-process reference
(every step's loss and every state_dict tensor within tests.reference.RTOL = 1e-5 relative)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests import models
from tests.reference import assert_matches_reference, train_reference
from tests.test_pipeline_parity import OPTIMIZERS, run_pipeline

pytestmark = pytest.mark.cluster  # every test here starts processes


def _dataflow(job) -> list[tuple]:
    return [(e["from_stage"], e["to_stage"], e["kind"], e["skip"]) for e in job.plan.report["dataflow"]]


def assert_moved_as_predicted(job):
    """Every rank's measured bytes of the last training step are the plan's prediction."""
    measured = {r: m["data_plane_bytes"] for r, m in job.last.memory.items()}
    assert measured == job.plan.predicted_communication, (measured, job.plan.predicted_communication)
    assert any(c["sent"] for c in measured.values())


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("split", ["auto", "names"])
def test_residual_across_two_boundaries_matches_single_process(client4, split, optimizer):
    """SkipNet's stem output is used again after the last block: with three stages it is one
    edge from stage 0 straight to stage 2. A block has BatchNorm, whose running statistics train."""
    model, batches, loss_fn = models.skip_net()
    split_points = ["blocks.1", "blocks.3"] if split == "names" else None
    job, losses, state = run_pipeline(
        client4,
        model,
        batches,
        loss_fn,
        stages=3,
        microbatches=4,
        schedule="1f1b",
        split_points=split_points,
        optimizer=optimizer,
        optimizer_args=OPTIMIZERS[optimizer],
    )
    flow = _dataflow(job)
    assert (0, 2, "remote", True) in flow, flow  # the residual skips stage 1
    assert sum(1 for src, dst, *_ in flow if (src, dst) == (0, 2)) == 1  # sent once, not hop by hop
    if split == "names":
        assert [s["modules"][0] for s in job.plan.report["stages"][1:]] == ["blocks.1", "blocks.3"]
    assert "(skip)" in job.plan.render()
    assert_moved_as_predicted(job)  # the skip edge's bytes leave stage 0 once, arrive at stage 2 once
    ref_losses, ref_state = train_reference(model, batches, loss_fn, 4, optimizer, OPTIMIZERS[optimizer])
    assert_matches_reference(losses, state, ref_losses, ref_state)
    assert any("running_mean" in k for k in state)  # BatchNorm's buffers came back, trained


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_tied_embedding_and_head_match_single_process(client4, optimizer):
    """The embedding (first stage) and the head (last stage) share one weight: each holder keeps a
    copy, their gradients are summed before every update, and both names come back equal."""
    model, batches, loss_fn = models.tied_lm()
    job, losses, state = run_pipeline(
        client4,
        model,
        batches,
        loss_fn,
        stages=3,
        microbatches=4,
        schedule="1f1b",
        optimizer=optimizer,
        optimizer_args=OPTIMIZERS[optimizer],
    )
    report = job.plan.report
    assert report["tied_parameters"] == {"embed.weight": [0, 2]}
    assert report["aliases"] == {"head.weight": "embed.weight"}
    assert "0REDUCE_GRAD" in report["actions"]["0"] and "2REDUCE_GRAD" in report["actions"]["2"]
    assert "REDUCE_GRAD" not in " ".join(report["actions"]["1"])
    ref_losses, ref_state = train_reference(model, batches, loss_fn, 4, optimizer, OPTIMIZERS[optimizer])
    assert_matches_reference(losses, state, ref_losses, ref_state)
    assert state["head.weight"].equal(state["embed.weight"])
    assert_moved_as_predicted(job)  # tied gradients included


@pytest.mark.parametrize("stages", [1, 2])
def test_interleaved_skip_and_tied_models_match_single_process(client4, stages):
    """Two chunks per rank: the skip edge and the tied weight's copies are partly or wholly on one
    rank (local hand-offs, a local gradient sum)."""
    for make in (models.skip_net, models.tied_lm):
        model, batches, loss_fn = make()
        job, losses, state = run_pipeline(
            client4,
            model,
            batches,
            loss_fn,
            stages=stages,
            microbatches=4,
            schedule="interleaved_1f1b",
            virtual_stages=2,
            optimizer="adamw",
            optimizer_args=OPTIMIZERS["adamw"],
        )
        kinds = {kind for _, _, kind, _ in _dataflow(job)} - {"batch"}
        assert kinds == {"local"} if stages == 1 else "remote" in kinds
        ref_losses, ref_state = train_reference(model, batches, loss_fn, 4, "adamw", OPTIMIZERS["adamw"])
        assert_matches_reference(losses, state, ref_losses, ref_state)
        for rank in range(stages):  # memory prediction still counts what the executor holds
            predicted, measured = job.plan.predicted_memory[rank]["total"], job.last.memory[rank]["peak"]["total"]
            assert predicted == measured, f"{make.__name__} rank {rank}: predicted {predicted}, measured {measured}"


class _ReusedChild(nn.Module):
    """Children used out of order and one of them twice: running the children in order would not
    compute this forward. Split between the two calls, ``b`` is tied across the stages."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.a(self.b(x)) + self.b(x)


def test_module_called_twice_matches_single_process(client4):
    torch.manual_seed(0)
    model = _ReusedChild()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in range(3)]
    args = OPTIMIZERS["sgd"]
    job, losses, state = run_pipeline(
        client4, model, batches, F.mse_loss, stages=2, microbatches=2, split_points=["a"], optimizer_args=args
    )
    assert job.plan.report["tied_parameters"] == {"b.weight": [0, 1], "b.bias": [0, 1]}
    ref_losses, ref_state = train_reference(model, batches, F.mse_loss, 2, "sgd", args)
    assert_matches_reference(losses, state, ref_losses, ref_state)


def test_hugging_face_causal_lm_matches_single_process(client4):
    """GPT-2 from transformers, random init, unmodified; the wrapper only returns the logits. Its
    token embedding is tied to the LM head, and the causal mask built in stage 0 is used by every
    block, so it travels to each later stage directly."""
    model, batches = models.hf_gpt2(pytest.importorskip("transformers"))
    # SGD: the key bias of attention gets a zero gradient in exact arithmetic (softmax ignores a
    # constant shift), so in floating point it gets rounding noise, which Adam's normalization
    # would turn into full-size steps whose sign depends on summation order (in one process too)
    args = OPTIMIZERS["sgd"]
    job, losses, state = run_pipeline(
        client4, model, batches, models.lm_loss, stages=4, microbatches=4, schedule="1f1b", optimizer="sgd",
        optimizer_args=args,
    )  # fmt: skip
    report = job.plan.report
    assert report["tied_parameters"] == {"lm.transformer.wte.weight": [0, 3]}
    assert {(src, dst) for src, dst, _, skip in _dataflow(job) if skip} >= {(0, 2), (0, 3)}
    ref_losses, ref_state = train_reference(model, batches, models.lm_loss, 4, "sgd", args)
    assert_matches_reference(losses, state, ref_losses, ref_state)


class _NoSubmodules(nn.Module):
    """All code in the model's own forward: the split falls back to cutting between operations.
    ``w`` is used on both sides of the cut, so it is tied."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 16) / 4)

    def forward(self, x):
        return torch.tanh(x @ self.w) @ self.w.t()


def test_model_without_submodules_is_cut_between_operations(client4):
    torch.manual_seed(0)
    model = _NoSubmodules()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in range(3)]
    args = OPTIMIZERS["adamw"]
    job, losses, state = run_pipeline(
        client4, model, batches, F.mse_loss, stages=2, microbatches=2, optimizer="adamw", optimizer_args=args
    )
    assert job.plan.report["tied_parameters"] == {"w": [0, 1]}
    ref_losses, ref_state = train_reference(model, batches, F.mse_loss, 2, "adamw", args)
    assert_matches_reference(losses, state, ref_losses, ref_state)
