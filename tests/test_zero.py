"""ZeRO stages 2 and 3 over data-parallel replicas against one process, each stage's model state
per replica against the ZeRO paper's count (it took over test_data_parallel's check that ZeRO-1
keeps half of plain data parallelism's optimizer state at D=2), and ZeRO jobs' checkpoints and
auto_resume (runtime/worker/executor/zero.py).

Parity as tests/reference.py says for AdamW: losses of the float32 run within 1e-5 relative, then a
float64 run's losses and every weight within 1e-5 relative."""

import pytest
import torch

import atoll
from tests import models
from tests.reference import assert_losses_match, assert_matches_reference, train_reference
from tests.test_tensor_parallel import OPTIMIZERS
from tests.test_tensor_parallel import _train as train_layout

pytestmark = pytest.mark.cluster  # every test here starts processes

ADAMW = OPTIMIZERS["adamw"]  # the arguments test_tensor_parallel's runs use
STEPS = 3


def _train(client, model, batches, loss_fn, stages: int, zero: int, replicas: int = 2, **layout):
    """test_tensor_parallel's run of a layout (1F1B, 2 microbatches), under AdamW with ZeRO."""
    return train_layout(
        client, model, batches, loss_fn, "adamw", stages=stages, data_parallel=replicas, zero=zero, **layout
    )


def _check_plan(job, results, stages: int, replicas: int = 2, island: int = 1) -> None:
    """Bytes moved, the peak and the model state at the optimizer step exactly as predicted (rank
    r of every replica alike)."""
    predicted, moved = job.plan.predicted_memory, job.plan.predicted_communication
    last = results[-1].memory  # from the second step on, the optimizer state exists
    for w in range(stages * island * replicas):
        rank = (w // island) % stages
        assert last[w]["data_plane_bytes"] == moved[rank], (w, last[w]["data_plane_bytes"], moved[rank])
        assert last[w]["at_step"] == predicted[rank]["at_step"], (w, last[w]["at_step"], predicted[rank]["at_step"])
        assert last[w]["peak"]["total"] == predicted[rank]["total"], (w, last[w]["peak"], predicted[rank])


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("stages", [1, 2], ids=["dp2", "pp2xdp2"])
def test_zero_on_the_gpt_example_matches_single_process(client4, stages, zero):
    model, batches, loss_fn = models.transformer()
    batches = batches[:STEPS]
    job, results, state, output = _train(client4, model, batches, loss_fn, stages, zero)
    ref_losses, _ = train_reference(model, batches, loss_fn, 4, "adamw", ADAMW)
    assert_losses_match([r.loss for r in results], ref_losses)
    _check_plan(job, results, stages)
    gathers = [a for a in job.plan.report["actions"]["0"] if "GATHER" in a]
    assert gathers == (["0GATHER"] if zero == 3 else []), job.plan.report["actions"]["0"]
    reference = models.transformer()[0]
    reference.load_state_dict(state)
    with torch.no_grad():
        assert torch.allclose(output, reference(batches[0][0]), rtol=1e-5, atol=1e-6)

    model = model.double()
    _, results, state, _ = _train(client4, model, batches, loss_fn, stages, zero)
    ref_losses, ref_state = train_reference(model, batches, loss_fn, 4, "adamw", ADAMW)
    assert_matches_reference([r.loss for r in results], state, ref_losses, ref_state)


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("stages", [1, 2], ids=["dp2", "pp2xdp2"])
def test_zero_on_hugging_face_gpt2_matches_single_process(client4, stages, zero):
    """GPT-2 from transformers; on two stages its embedding is tied to the LM head across them,
    so the tied gradients are summed before the replicas reduce-scatter them."""
    model, batches = models.hf_gpt2(pytest.importorskip("transformers"))
    batches = batches[:STEPS]
    job, results, _, _ = _train(client4, model, batches, models.lm_loss, stages, zero)
    ref_losses, _ = train_reference(model, batches, models.lm_loss, 4, "adamw", ADAMW)
    assert_losses_match([r.loss for r in results], ref_losses)
    _check_plan(job, results, stages)
    model = model.double()
    _, results, state, _ = _train(client4, model, batches, models.lm_loss, stages, zero)
    ref_losses, ref_state = train_reference(model, batches, models.lm_loss, 4, "adamw", ADAMW)
    assert_matches_reference([r.loss for r in results], state, ref_losses, ref_state)


@pytest.mark.parametrize("family", ["gpt", "hf-gpt2"])
def test_zero3_with_tensor_parallel_islands_matches_single_process(client4, family):
    """TP=2 x DP=2: each island rank's shard of the parameters is itself sharded over the replicas
    (float64: losses and every weight within 1e-5)."""
    if family == "gpt":
        model, batches, loss_fn = models.transformer()
    else:
        (model, batches), loss_fn = models.hf_gpt2(pytest.importorskip("transformers")), models.lm_loss
    batches = batches[:STEPS]
    model = model.double()
    job, results, state, _ = _train(client4, model, batches, loss_fn, 1, 3, tensor_parallel=2)
    assert job.plan.report["layout"]["tensor"] == 2 and job.plan.report["layout"]["data"] == 2
    _check_plan(job, results, 1, island=2)
    ref_losses, ref_state = train_reference(model, batches, loss_fn, 4, "adamw", ADAMW)
    assert_matches_reference([r.loss for r in results], state, ref_losses, ref_state)


@pytest.mark.parametrize("replicas", [2, 4])
def test_model_state_per_replica_follows_the_zero_paper(client4, replicas):
    """Per replica, with Psi parameters in float32 under AdamW (two moments): plain data
    parallelism holds 4 Psi of parameters, 4 Psi of gradients and 8 Psi of optimizer state;
    ZeRO-1 divides the optimizer state by D, ZeRO-2 the gradients too, ZeRO-3 the parameters too
    (Rajbhandari et al., 2020, section 5, with float32 in place of mixed precision). Measured at
    the optimizer step, within 5% (padding to equal shards and AdamW's step counters)."""
    model, batches, loss_fn = models.transformer()
    psi = sum(p.numel() for p in model.parameters())
    x, y = batches[0]
    for zero in (0, 1, 2, 3):
        job = client4.pipeline(
            model, example_input=x, example_target=y, loss_fn=loss_fn, stages=1, microbatches=1,
            optimizer="adamw", optimizer_args=ADAMW, data_parallel=replicas, zero=zero,
        )  # fmt: skip
        try:
            for xb, yb in batches[:2]:
                job.step(xb, yb)
            measured = job.last.memory
        finally:
            job.close()
        paper = {
            "parameters": 4 * psi / (replicas if zero >= 3 else 1),
            "gradients": 4 * psi / (replicas if zero >= 2 else 1),
            "optimizer": 8 * psi / (replicas if zero >= 1 else 1),
        }
        for w in range(replicas):
            state = measured[w]["at_step"]
            assert state == job.plan.predicted_memory[0]["at_step"], (zero, w, state)
            for kind, expected in paper.items():
                assert abs(state[kind] - expected) <= 0.05 * expected, (zero, w, kind, state[kind], expected)
            peak, predicted = measured[w]["peak"]["total"], job.plan.predicted_memory[0]["total"]
            assert abs(peak - predicted) <= 0.1 * predicted, (zero, w, peak, predicted)


def test_a_zero3_checkpoint_resumes_at_another_data_parallel_degree_and_stage_count(client4, tmp_path):
    """Saved by ZeRO-3 at D=4 on one stage, resumed by ZeRO-3 at D=2 on two stages: the replicas
    gather their shards for the save, so the checkpoint is per parameter, whatever the layout; the
    losses go on as one uninterrupted process's (float64, 1e-5)."""
    model, batches, loss_fn = models.transformer()
    model = model.double()
    x, y = batches[0]  # 16 rows: 4 replicas x 2 microbatches of 2
    expected, _ = train_reference(model, batches, loss_fn, 8, "adamw", ADAMW)
    settings = dict(example_input=x, example_target=y, loss_fn=loss_fn, optimizer="adamw", optimizer_args=ADAMW)
    job = client4.pipeline(model, stages=1, microbatches=2, data_parallel=4, zero=3, **settings)
    try:
        losses = [job.step(*b) for b in batches[:2]]
        job.save(tmp_path / "ckpt")
    finally:
        job.close()
    resumed = client4.pipeline(
        model, stages=2, microbatches=4, data_parallel=2, zero=3, resume_from=tmp_path / "ckpt", **settings
    )
    try:
        losses += [resumed.step(*b) for b in batches[2:]]
    finally:
        resumed.close()
    assert_losses_match(losses, expected)


@pytest.mark.parametrize("zero", [1, 3])
def test_auto_resume_of_a_zero_job_after_a_worker_is_killed(tmp_path, zero):
    """DP=2 on one stage each, a spare worker: a replica's worker is killed after the checkpoint
    of step 2; the job resumes on the spare from it and its losses are the uninterrupted run's."""
    model, batches, loss_fn = models.transformer()
    x, y = batches[0]
    expected, _ = train_reference(model, batches, loss_fn, 4, "adamw", ADAMW)
    with atoll.LocalCluster(workers=3) as cluster, cluster.client() as client:
        job = client.pipeline(
            model, example_input=x, example_target=y, loss_fn=loss_fn, stages=1, microbatches=2,
            optimizer="adamw", optimizer_args=ADAMW, data_parallel=2, zero=zero,
            auto_resume=True, checkpoint_every=2, checkpoint_path=tmp_path / "ckpt",
        )  # fmt: skip
        try:
            losses = [job.step(*b) for b in batches[:3]]
            victim = client.job(job.id).plan.report["placement"]["0"].split()[0]
            pid = next(w.pid for w in client.status().workers if w.worker_id == victim)
            cluster.kill_worker(next(i for i, p in enumerate(cluster.workers) if p.pid == pid))
            losses += [job.step(*b) for b in batches[3:]]
            (restore,) = client.job(job.id).plan.report["restores"]
        finally:
            job.close()
    assert restore["lost"] == [victim] and restore["from_step"] == 2
    assert_losses_match(losses, expected)
