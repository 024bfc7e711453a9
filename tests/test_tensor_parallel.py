"""Tensor parallelism (Megatron-LM): each stage sharded over an island of workers, against one
process training the same model (tests.reference.RTOL = 1e-5 relative, fp32), alone and with
pipeline and data parallelism; bad layouts refused before anything loads."""

import copy

import pytest
import torch

import atoll
from examples.gpt import GPTConfig, build_gpt
from tests import models
from tests.reference import assert_losses_match, assert_matches_reference, train_reference

pytestmark = pytest.mark.cluster  # every test here starts processes

OPTIMIZERS = {"sgd": {"lr": 0.05, "momentum": 0.9}, "adamw": {"lr": 1e-3, "weight_decay": 0.01}}


@pytest.fixture(scope="module")
def cluster8():
    with atoll.LocalCluster(workers=8) as cluster:
        yield cluster


def _train(client, model, batches, loss_fn, optimizer, **layout):
    x, y = batches[0]
    job = client.pipeline(
        model, example_input=x, example_target=y, loss_fn=loss_fn, microbatches=2, schedule="1f1b",
        optimizer=optimizer, optimizer_args=OPTIMIZERS[optimizer], **layout,
    )  # fmt: skip
    try:
        results = [job.step_async(x, y).details() for x, y in batches]
        state = job.state_dict()
        output = job.forward(batches[0][0])
    finally:
        job.close()
    return job, results, state, output


def _check(job, results, state, output, model, batches, loss_fn, optimizer, replicas=1, losses_only=False):
    """``losses_only``: a float32 run under AdamW, whose weights are compared in a float64 run
    (tests/reference.py, "AdamW parity")."""
    stages, islands = job.plan.report["ranks"], job.plan.report["tensor_parallel"]
    losses = [r.loss for r in results]
    ref_losses, ref_state = train_reference(model, batches, loss_fn, 2 * replicas, optimizer, OPTIMIZERS[optimizer])
    if losses_only:
        assert_losses_match(losses, ref_losses)
    else:
        assert_matches_reference(losses, state, ref_losses, ref_state)
    rank_of = lambda w: (w // islands) % stages  # noqa: E731 (worker (d * stages + r) * T + t)
    workers = stages * islands * replicas
    for r in results:
        assert sorted(r.memory) == list(range(workers))
        for w in range(workers):  # what each worker moved, as the plan predicted, collectives included
            assert r.memory[w]["data_plane_bytes"] == job.plan.predicted_communication[rank_of(w)], w
            assert r.memory[w]["data_plane_bytes"]["island_all_reduced"] > 0
    for w in range(workers):  # from the second step on, when the optimizer state exists
        measured, expected = results[-1].memory[w]["peak"]["total"], job.plan.predicted_memory[rank_of(w)]["total"]
        assert abs(measured - expected) <= 0.1 * expected, (w, measured, expected)
    reference = copy.deepcopy(model)
    reference.load_state_dict(state)
    with torch.no_grad():
        expected = reference(batches[0][0])
    assert output.shape == expected.shape  # the logits' vocabulary slices joined
    assert torch.allclose(output, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stages, sequence", [(1, False), (1, True), (2, False)], ids=["tp2", "tp2-sp", "pp2xtp2"])
def test_tensor_parallel_gpt_matches_single_process(client4, stages, sequence, optimizer):
    model, batches, loss_fn = models.transformer()
    job, results, state, output = _train(
        client4, model, batches, loss_fn, optimizer, stages=stages, tensor_parallel=2, sequence_parallel=sequence
    )
    _check(job, results, state, output, model, batches, loss_fn, optimizer)
    assert job.plan.report["layout"]["sequence_parallel"] == sequence
    ops = {
        c["op"]
        for s in job.plan.report["stages"]
        for p in s["tensor_parallel"]["collectives_per_microbatch"].values()
        for c in p
    }
    assert (
        "reduce_scatter" in ops
    ) == sequence  # Korthikanti et al.: reduce-scatter and all-gather in place of g and f
    modules = {m: role for s in job.plan.report["stages"] for m, role in s["tensor_parallel"]["modules"].items()}
    assert modules["1.qkv"] == modules["1.mlp.0"] == "colwise"  # Megatron's pairs, found in the graph
    assert modules["1.proj"] == modules["1.mlp.2"] == "rowwise"
    assert modules["0.tokens"] == "vocab_embedding" and modules["5.out"] == "vocab_head"
    cut = {n: p for s in job.plan.report["stages"] for n, p in s["tensor_parallel"]["sharded_parameters"].items()}
    assert cut["1.qkv.weight"] == {"dim": 0, "blocks": [32, 32, 32]}  # q, k and v each by heads
    assert "0.positions.weight" not in cut  # looked up by position, not by token: stays whole


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_tensor_parallel_hugging_face_gpt2_matches_single_process(client4, optimizer):
    """transformers' GPT-2 (Conv1D layers: addmm with [in, out] weights, a fused QKV, a mask built
    from the input), its embedding tied to the LM head, on two stages of two-worker islands. With
    AdamW, the float32 runs are held to their losses, float64 runs to losses and weights."""
    model, batches = models.hf_gpt2(pytest.importorskip("transformers"))
    adamw = optimizer == "adamw"
    for stages, sequence in ((1, False), (1, True), (2, False)):
        for net in (model, copy.deepcopy(model).double()) if adamw else (model,):
            job, results, state, output = _train(
                client4, net, batches, models.lm_loss, optimizer, stages=stages, tensor_parallel=2,
                sequence_parallel=sequence,
            )  # fmt: skip
            losses_only = adamw and net is model
            _check(job, results, state, output, net, batches, models.lm_loss, optimizer, losses_only=losses_only)
    assert job.plan.report["tied_parameters"] == {"lm.transformer.wte.weight": [0, 1]}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_pipeline_tensor_and_data_parallel_on_eight_workers(cluster8, optimizer):
    """PP=2 x TP=2 x DP=2: two replicas of a two-stage pipeline whose stages each span two
    workers; with AdamW, also ZeRO-1 over the replicas and sequence parallelism in the islands
    (activations sliced as they enter a stage, gathered as they leave)."""
    model, batches, loss_fn = models.transformer()
    more = int(optimizer == "adamw")
    with cluster8.client() as client:
        job, results, state, output = _train(
            client, model, batches, loss_fn, optimizer, stages=2, tensor_parallel=2, data_parallel=2, zero=more,
            sequence_parallel=bool(more),
        )  # fmt: skip
    assert job.plan.report["layout"] == {
        "pipeline": 2, "tensor": 2, "data": 2, "workers": 8, "sequence_parallel": bool(more)
    }  # fmt: skip
    _check(job, results, state, output, model, batches, loss_fn, optimizer, replicas=2)


def test_bad_tensor_parallel_layouts_are_refused_before_loading(client4):
    model, batches, loss_fn = models.transformer()
    x, y = batches[0]
    args = dict(example_input=x, example_target=y, loss_fn=loss_fn, microbatches=2)
    with pytest.raises(atoll.InvalidInput, match="tensor_parallel must be a positive integer, got 0"):
        client4.pipeline(model, stages=1, tensor_parallel=0, **args)
    with pytest.raises(atoll.NotEnoughWorkers, match="needs 8 workers"):
        client4.pipeline(model, stages=2, tensor_parallel=2, data_parallel=2, **args)
    six_heads = build_gpt(GPTConfig(vocab_size=24, block_size=16, d_model=48, n_heads=6, n_layers=1))
    with pytest.raises(atoll.InvalidInput, match="tensor_parallel=4 does not divide the 6 heads"):
        client4.pipeline(six_heads, stages=1, tensor_parallel=4, **args)
    _, mlp_batches, mse = models.mlp()
    one_layer = torch.nn.Sequential(torch.nn.Linear(16, 4))  # its only cut would feed the loss sharded
    with pytest.raises(atoll.InvalidInput, match="stage 0 is too small to shard over tensor_parallel=2"):
        client4.pipeline(
            one_layer, example_input=mlp_batches[0][0], example_target=mlp_batches[0][1], loss_fn=mse,
            microbatches=2, stages=1, tensor_parallel=2,
        )  # fmt: skip
    with pytest.raises(atoll.InvalidInput, match="says '1.proj' is colwise, but it cannot be"):
        client4.pipeline(model, stages=1, tensor_parallel=2, tensor_parallel_plan={"1.proj": "colwise"}, **args)
    with pytest.raises(atoll.InvalidInput, match="unknown role"):
        client4.pipeline(model, stages=1, tensor_parallel=2, tensor_parallel_plan={"1.proj": "diagonal"}, **args)
    with pytest.raises(atoll.InvalidInput, match="needs tensor_parallel > 1"):
        client4.pipeline(model, stages=1, tensor_parallel_plan={"1.proj": "replicate"}, **args)
    with pytest.raises(atoll.InvalidInput, match="sequence_parallel slices .*: needs tensor_parallel > 1"):
        client4.pipeline(model, stages=1, sequence_parallel=True, **args)
    assert all(not w.jobs for w in client4.status().workers)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_hugging_face_gpt2_on_eight_workers(cluster8, optimizer):
    """GPT-2 from transformers as PP=2 x TP=2 x DP=2, sequence-parallel: its tied embedding and
    head are cut alike by vocabulary on the two stages, their gradients summed within each
    chain, then averaged across replicas; with AdamW, ZeRO-1 over the replicas too."""
    model, batches = models.hf_gpt2(pytest.importorskip("transformers"))
    adamw = optimizer == "adamw"
    for net in (model, copy.deepcopy(model).double()) if adamw else (model,):
        with cluster8.client() as client:
            job, results, state, output = _train(
                client, net, batches, models.lm_loss, optimizer, stages=2, tensor_parallel=2, data_parallel=2,
                sequence_parallel=True, zero=int(adamw),
            )  # fmt: skip
        losses_only = adamw and net is model  # float32 under AdamW: its losses; float64: everything
        _check(
            job, results, state, output, net, batches, models.lm_loss, optimizer, replicas=2, losses_only=losses_only
        )


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_llama_family_on_eight_workers(cluster8, family):
    """Llama and Mistral from transformers (grouped-query attention, rotary, SwiGLU) as PP=2 x TP=2 x
    DP=2 with ZeRO-1 under AdamW: every projection cut; the float32 run held to its losses, the
    float64 run to losses and weights (tests/reference.py, "AdamW parity")."""
    model, batches = models.hf_llama(pytest.importorskip("transformers"), family)
    for net in (model, copy.deepcopy(model).double()):
        with cluster8.client() as client:
            job, results, state, output = _train(
                client, net, batches, models.lm_loss, "adamw", stages=2, tensor_parallel=2, data_parallel=2, zero=1
            )
        models.assert_llama_projections_sharded(models.tp_roles(job.plan.report))
        _check(job, results, state, output, net, batches, models.lm_loss, "adamw", replicas=2, losses_only=net is model)
