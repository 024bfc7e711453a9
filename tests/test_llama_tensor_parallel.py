"""Tensor parallelism on Llama-family models (issue 26): grouped-query attention with rotary
positions is sharded by heads like the MLP, every projection cut, against one process in float64
under AdamW (weights and losses within 1e-5 relative, tests/reference.py)."""

import copy

import pytest
import torch

from tests import models
from tests.reference import assert_losses_match, assert_matches_reference, train_reference

transformers = pytest.importorskip("transformers")

ADAMW = {"lr": 1e-3, "weight_decay": 0.01}
FAMILIES = ["llama", "llama-bias", "mistral"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_plan_shards_every_projection_of_a_llama_family_model(family):
    """Compiled in this process: rotary's slices and concatenation, repeat_kv's expand and the
    grouped-query attention are followed, so no projection is left whole."""
    model, batches = models.hf_llama(transformers, family)
    x, y = batches[0]
    compiled = models.compile_locally(model, x, y, models.lm_loss, stages=1, microbatches=2, tensor_parallel=2)
    roles = models.tp_roles(compiled.report({}))
    models.assert_llama_projections_sharded(roles)
    cut = {n: p for s in compiled.report({})["stages"] for n, p in s["tensor_parallel"]["sharded_parameters"].items()}
    assert cut["lm.model.layers.0.self_attn.k_proj.weight"]["dim"] == 0  # 2 key/value heads: one per rank
    if family == "llama-bias":
        assert cut["lm.model.layers.0.self_attn.q_proj.bias"]["dim"] == 0


def _train(client, model, batches, **layout):
    x, y = batches[0]
    job = client.pipeline(
        model, example_input=x, example_target=y, loss_fn=models.lm_loss, microbatches=2, optimizer="adamw",
        optimizer_args=ADAMW, **layout,
    )  # fmt: skip
    try:
        results = [job.step_async(*b).details() for b in batches]
        state = job.state_dict()
        output = job.forward(x)
    finally:
        job.close()
    return job, results, state, output


def _check_in_float32_and_float64(client, model, batches, **layout):
    """The float32 run's losses, then a float64 run's losses, weights, outputs, bytes and memory
    against one process (tests/reference.py, "AdamW parity"); returns the float64 run's job."""
    job, results, _, _ = _train(client, model, batches, **layout)
    assert_losses_match(
        [r.loss for r in results], train_reference(model, batches, models.lm_loss, 2, "adamw", ADAMW)[0]
    )
    model = copy.deepcopy(model).double()
    job, results, state, output = _train(client, model, batches, **layout)
    ref_losses, ref_state = train_reference(model, batches, models.lm_loss, 2, "adamw", ADAMW)
    assert_matches_reference([r.loss for r in results], state, ref_losses, ref_state)
    cut = {n: p for s in job.plan.report["stages"] for n, p in s["tensor_parallel"]["sharded_parameters"].items()}
    whole_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cut_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n in cut)
    for w in range(2):  # the plan's collectives and peak memory, as the workers measured them
        held = results[-1].memory[w]["peak"]["parameters"]  # the cut layers' 1/T, the rest whole
        assert held == whole_bytes - cut_bytes + cut_bytes // 2, (w, held, whole_bytes, cut_bytes)
        assert results[-1].memory[w]["data_plane_bytes"] == job.plan.predicted_communication[0]
        measured, expected = results[-1].memory[w]["peak"]["total"], job.plan.predicted_memory[0]["total"]
        assert abs(measured - expected) <= 0.1 * expected, (w, measured, expected)
    reference = copy.deepcopy(model)
    reference.load_state_dict(state)
    with torch.no_grad():
        assert torch.allclose(output, reference(batches[0][0]), rtol=1e-9, atol=1e-9)
    return job


@pytest.mark.cluster
@pytest.mark.parametrize(
    "family, sequence", [(f, False) for f in FAMILIES] + [("llama", True), ("mistral", True)],
    ids=[*FAMILIES, "llama-sp", "mistral-sp"],
)  # fmt: skip
def test_tensor_parallel_llama_family_matches_one_process(client4, family, sequence):
    """TP=2, and TP=2 with sequence parallelism (RMSNorm and the residual adds on each rank's slice
    of the sequence; the sequence gathered whole before the projections, so rotary positions apply
    to the whole sequence there)."""
    model, batches = models.hf_llama(transformers, family)
    job = _check_in_float32_and_float64(
        client4, model, batches, stages=1, tensor_parallel=2, sequence_parallel=sequence
    )
    assert job.plan.report["layout"]["sequence_parallel"] == sequence
    models.assert_llama_projections_sharded(models.tp_roles(job.plan.report))


@pytest.mark.cluster
def test_a_fused_gate_up_projection_is_cut_per_block_and_matches_one_process(client4):
    model, batches, _ = models.fused_gate_up()
    job = _check_in_float32_and_float64(client4, model, batches, stages=1, tensor_parallel=2)
    cut = job.plan.report["stages"][0]["tensor_parallel"]["sharded_parameters"]
    assert cut["gate_up_proj.weight"] == {"dim": 0, "blocks": [64, 64]}  # gate and up, each by features
    assert job.plan.report["stages"][0]["tensor_parallel"]["modules"]["down_proj"] == "rowwise"
