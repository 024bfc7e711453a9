"""ZeRO-3 with ``reshard_after_forward`` (FSDP2's per-unit gathers): each stage a unit, gathered
before each of its computes and freed after it, the next compute's unit gathered while the current
one runs, its gradients reduce-scattered after its last backward (runtime/worker/executor/zero.py,
controller/compiler/lowering.py's ``_unit_actions``).

Parity as tests/reference.py says for AdamW: a float32 run's losses within 1e-5 relative, a
float64 run's losses and every weight within 1e-5 relative; bytes, the peak and the model state at
the step exactly as predicted."""

import re

import pytest

from atoll.controller.compiler.lowering import _unit_actions
from atoll.core.actions import B, F
from tests import models
from tests.reference import assert_losses_match, assert_matches_reference, train_reference
from tests.test_zero import ADAMW, STEPS, _check_plan

UNITS = 4  # a pure data-parallel job cut into four units (its chunks)


def test_each_compute_has_its_unit_gathered_and_the_next_one_prefetched():
    """Pure logic: what the lowering puts around a rank's computes."""
    computes = [F(0, 0), F(1, 0), B(1, 0), B(0, 0)]
    units = _unit_actions(computes, reduce_early=True)
    lines = [" ".join(map(str, [*units.before[i], c, *units.after[i]])) for i, c in enumerate(computes)]
    assert lines == [
        "0GATHER 1GATHER 0F0 0RELEASE",  # the second unit gathers while the first one computes
        "1F0",  # the next compute is its own: no release, no gather
        "0GATHER 1B0 1ALL_REDUCE_GRAD 1RELEASE",  # its last backward: reduce-scattered and freed
        "0B0 0ALL_REDUCE_GRAD 0RELEASE",
    ]
    assert units.at_end == []
    late = _unit_actions(computes, reduce_early=False)  # tied parameters: summed first, at the end
    assert [str(a) for a in late.at_end] == ["0ALL_REDUCE_GRAD", "1ALL_REDUCE_GRAD"]
    assert not any("ALL_REDUCE" in str(a) for after in late.after for a in after)


def _assert_every_compute_has_its_unit(actions: list[str]) -> None:
    """Every compute runs with its stage's unit gathered, and units are gathered again for their
    backwards (more gathers than units)."""
    held, gathers, units = set(), 0, set()
    for text in actions:
        stage, code, _ = re.fullmatch(r"(\d+)([A-Z_]+?)(\d*)", text).groups()
        if code == "GATHER":
            held.add(stage)
            gathers += 1
        elif code == "RELEASE":
            held.remove(stage)
        elif code in ("F", "B", "I", "W"):
            assert stage in held, (text, actions)
            units.add(stage)
    assert not held, actions  # all freed by the step's end
    assert gathers > len(units) > 1, actions


def _train(client, model, batches, loss_fn, reshard: bool, **layout):
    x, y = batches[0]
    layout = {"stages": 1, "virtual_stages": UNITS, "schedule": "interleaved_1f1b", **layout}
    job = client.pipeline(
        model, example_input=x, example_target=y, loss_fn=loss_fn, microbatches=2, optimizer="adamw",
        optimizer_args=ADAMW, data_parallel=2, zero=3, reshard_after_forward=reshard, **layout,
    )  # fmt: skip
    try:
        results = [job.step_async(x, y).details() for x, y in batches]
        state = job.state_dict()
    finally:
        job.close()
    return job, results, state


@pytest.mark.cluster
@pytest.mark.parametrize(
    "family, layout",
    [
        ("gpt", {}),
        ("gpt", {"stages": 2, "virtual_stages": 2}),
        ("gpt", {"virtual_stages": 2, "tensor_parallel": 2}),
        ("hf-gpt2", {}),
    ],
    ids=["dp2-4units", "pp2xdp2-2units", "tp2xdp2-2units", "hf-gpt2-dp2-4units"],
)
def test_per_unit_gathers_match_single_process_and_their_memory_plan(client4, family, layout):
    """Each layout in float64 (losses and every weight), the first also in float32 (losses). In the
    tensor-parallel layout each island rank's shard of a unit is sharded again over the replicas;
    Hugging Face's GPT-2 ties its embedding (first unit) to its LM head (last unit): the copies'
    gradients are summed before the units reduce-scatter."""
    if family == "gpt":
        model, batches, loss_fn = models.transformer()
    else:
        (model, batches), loss_fn = models.hf_gpt2(pytest.importorskip("transformers")), models.lm_loss
    batches = batches[:STEPS]
    island = layout.get("tensor_parallel", 1)
    if not layout and family == "gpt":
        job, results, _ = _train(client4, model, batches, loss_fn, True, **layout)
        ref_losses, _ = train_reference(model, batches, loss_fn, 4, "adamw", ADAMW)
        assert_losses_match([r.loss for r in results], ref_losses)

    model = model.double()
    job, results, state = _train(client4, model, batches, loss_fn, True, **layout)
    ref_losses, ref_state = train_reference(model, batches, loss_fn, 4, "adamw", ADAMW)
    assert_matches_reference([r.loss for r in results], state, ref_losses, ref_state)
    _check_plan(job, results, layout.get("stages", 1), island=island)
    actions = job.plan.report["actions"]["0"]
    _assert_every_compute_has_its_unit(actions)
    if family == "hf-gpt2":  # the tied copies summed before any unit's reduce-scatter
        assert actions.index("0REDUCE_GRAD") < min(i for i, a in enumerate(actions) if a.endswith("ALL_REDUCE_GRAD"))


@pytest.mark.cluster
def test_per_unit_gathers_hold_less_than_gathering_the_rank_for_the_step(client4):
    """The point of resharding: at the peak a replica holds its shards and about two of its four
    units whole (the one computing and the one prefetched), where gathering the rank for the step
    holds its shard and the whole flat buffer (at D=2: three shards' worth, test_zero's plans)."""
    model, batches, loss_fn = models.transformer(layers=8)
    psi_bytes = 4 * sum(p.numel() for p in model.parameters())
    job, results, _ = _train(client4, model, batches[:2], loss_fn, True)
    predicted = job.plan.predicted_memory[0]
    for w in (0, 1):  # every category at the peak as predicted, parameters included
        measured = results[-1].memory[w]["peak"]
        assert measured == {k: predicted[k] for k in measured}, (w, measured, predicted)
    shards = predicted["at_step"]["parameters"]  # the paper's 4 Psi / D, its shards between steps
    assert psi_bytes / 2 <= shards <= 1.05 * psi_bytes / 2
    whole_rank = shards + 2 * shards  # its shard and every replica's, gathered
    held = predicted["parameters"] - shards  # the units held whole at the peak
    assert 0.2 * psi_bytes <= held <= 0.55 * psi_bytes, (held, psi_bytes)
    assert predicted["parameters"] <= whole_rank - 0.45 * psi_bytes


@pytest.mark.cluster
def test_reshard_after_forward_needs_zero3(client4):
    model, batches, loss_fn = models.transformer()
    x, y = batches[0]
    with pytest.raises(Exception, match="reshard_after_forward .* needs zero=3, got zero=2"):
        client4.pipeline(
            model, example_input=x, example_target=y, loss_fn=loss_fn, stages=1, microbatches=2,
            data_parallel=2, zero=2, reshard_after_forward=True,
        )  # fmt: skip


@pytest.mark.cluster
def test_a_checkpoint_moves_between_per_unit_and_per_rank_gathers(client4, tmp_path):
    """Saved by four units per replica, resumed by ZeRO-3 gathering per rank on two stages, then
    saved again and resumed per unit: each replica's unit shards export whole and load back into
    another layout; the losses go on as one uninterrupted process's (float64, 1e-5)."""
    model, batches, loss_fn = models.transformer()
    model = model.double()
    x, y = batches[0]
    expected, _ = train_reference(model, batches, loss_fn, 4, "adamw", ADAMW)
    settings = dict(example_input=x, example_target=y, loss_fn=loss_fn, optimizer="adamw", optimizer_args=ADAMW)
    per_unit = dict(stages=1, virtual_stages=UNITS, schedule="interleaved_1f1b", reshard_after_forward=True)
    runs = [(per_unit, batches[:2]), (dict(stages=2, schedule="1f1b"), batches[2:4]), (per_unit, batches[4:])]
    losses, resume_from = [], ""
    for i, (layout, steps) in enumerate(runs):
        job = client4.pipeline(
            model, microbatches=2, data_parallel=2, zero=3, resume_from=resume_from, **layout, **settings
        )
        try:
            losses += [job.step(*b) for b in steps]
            resume_from = tmp_path / f"ckpt{i}"
            job.save(resume_from)
        finally:
            job.close()
    assert len(losses) == len(batches) == 5
    assert_losses_match(losses, expected)
