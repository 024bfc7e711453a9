"""Several steps in one call (Job.steps_async): the same steps as one by one, at a call's cost; on
batches held by the workers that read them (Job.put_batch), with no batch bytes at all."""

import pytest
import torch

import atoll
from atoll.core.wire import replica_rows
from tests import models
from tests.reference import assert_matches_reference, train_reference

pytestmark = pytest.mark.cluster  # every test here starts processes

ADAMW = {"lr": 1e-3}


def _mlp64(seed: int = 0):
    """tests.models.mlp in float64, so that a mismatch with the reference is not rounding."""
    return models.in_float64(lambda: models.mlp(seed))


def _free(held: list) -> None:
    """Free batches placed by ``Job.put_batch``."""
    for x, y in held:
        x.free()
        y.free()


@pytest.mark.parametrize("layout", [{"stages": 4}, {"stages": 2, "data_parallel": 2}], ids=["pp4", "pp2xdp2"])
def test_steps_sent_together_match_the_reference_and_steps_sent_one_by_one(client4, layout):
    args = dict(microbatches=2, schedule="1f1b", optimizer="adamw", optimizer_args=ADAMW, **layout)
    together, model, batches, loss_fn = models.submit(client4, make=_mlp64, **args)
    one_by_one, *_ = models.submit(client4, make=_mlp64, **args)
    try:
        futures = together.steps_async(batches[:3]) + together.steps_async(batches[3:])
        state = together.state_dict()
        assert [f.details().step for f in futures] == [1, 2, 3, 4, 5] and together.last.step == 5
        losses = [f.result() for f in futures]
        singles = [one_by_one.step_async(x, y) for x, y in batches]
        assert losses == [f.result() for f in singles]  # the same steps: bit for bit
        single_state = one_by_one.state_dict()
        assert all(torch.equal(state[k], single_state[k]) for k in state)
        memory = futures[-1].details().memory
        assert set(memory) == set(range(4)) and all(m["control_plane_tensor_bytes"] >= 0 for m in memory.values())
        # the same two steps more, on batches the workers hold (Job.put_batch) and on tensors: in a
        # data-parallel job the second replica pulls its own rows of each value, no more
        held = [together.put_batch(x, y) for x, y in batches[:2]]
        on_held = [f.result() for f in together.steps_async(held)]
        assert on_held == [f.result() for f in one_by_one.steps_async(batches[:2])]
        held_state, sent_state = together.state_dict(), one_by_one.state_dict()
        assert all(torch.equal(held_state[k], sent_state[k]) for k in held_state)
        assert all(m["control_plane_tensor_bytes"] == 0 for m in together.last.memory.values())
        received = [
            sum(m["data_plane_bytes"]["received"] for m in j.last.memory.values()) for j in (together, one_by_one)
        ]
        pulled = sum(replica_rows(t, 1, 2).nbytes for t in batches[1])  # replica 1's rows, by its readers
        assert received[0] - received[1] == (pulled if layout.get("data_parallel") else 0)
        _free(held)
    finally:
        together.close()
        one_by_one.close()
    ref_losses, ref_state = train_reference(model, batches, loss_fn, 2, "adamw", ADAMW)
    assert_matches_reference(losses, state, ref_losses, ref_state, rtol=1e-12)


def test_a_bad_step_among_several_refuses_the_call_and_runs_nothing(client4):
    job, _, batches, _ = models.submit(client4, stages=2, microbatches=2)
    try:
        job.step(*batches[0])
        before = job.state_dict()
        (x, y), wrong = batches[1], (batches[2][0][:, :8], batches[2][1])
        futures = job.steps_async([(x, y), wrong, (x, y)])
        for future in futures:
            with pytest.raises(atoll.InvalidInput, match="edge 'input': expected"):
                future.result()
        after = job.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)  # nothing ran
        refused = job.step_async(*wrong)  # alone, too: refused, and state_dict still answers
        assert torch.equal(job.state_dict()[next(iter(before))], after[next(iter(before))])
        with pytest.raises(atoll.InvalidInput, match="edge 'input': expected"):
            refused.result()
        assert job.step_async(x, y).details().step == 6  # the refused call used up steps 2 to 4, then 5
        with pytest.raises(atoll.InvalidInput, match="at least one"):
            job.steps_async([])
    finally:
        job.close()


def test_steps_together_on_a_sequential_dispatch_job_run_one_by_one(client4):
    """A job whose steps go out another way (here ``dispatch="sequential"``) takes them as
    separate steps: the same results, the same numbers."""
    job, model, batches, loss_fn = models.submit(client4, stages=4, microbatches=2, dispatch="sequential")
    try:
        futures = job.steps_async(batches)
        losses = [f.result() for f in futures]
        assert [f.details().step for f in futures] == [1, 2, 3, 4, 5]
        state = job.state_dict()
    finally:
        job.close()
    ref_losses, ref_state = train_reference(model, batches, loss_fn, 2, "sgd", {})
    assert_matches_reference(losses, state, ref_losses, ref_state)


def test_steps_together_on_batches_held_by_their_readers(client4):
    """``put_batch`` places each batch's input on the first rank's worker and its target on the
    last's; steps sent together on those handles are the steps on the tensors, bit for bit, and
    no step carries a batch's bytes, nor moves them between workers."""
    args = dict(stages=3, microbatches=2, schedule="zb_h1", optimizer="adamw", optimizer_args=ADAMW)
    held, model, batches, loss_fn = models.submit(client4, make=_mlp64, **args)
    sent, *_ = models.submit(client4, make=_mlp64, **args)
    handles = [held.put_batch(x, y) for x, y in batches]
    try:
        placement = held.plan.report["placement"]
        first, last = placement["0"].split()[0], placement["2"].split()[0]
        assert {(x.worker_id, y.worker_id) for x, y in handles} == {(first, last)}
        futures = held.steps_async(handles[:3]) + held.steps_async(handles[3:])
        losses = [f.result() for f in futures]
        sent_futures = sent.steps_async(batches)
        assert losses == [f.result() for f in sent_futures]
        state, sent_state = held.state_dict(), sent.state_dict()
        assert all(torch.equal(state[k], sent_state[k]) for k in state)
        memory, sent_memory = futures[-1].details().memory, sent_futures[-1].details().memory
        assert all(m["control_plane_tensor_bytes"] == 0 for m in memory.values())
        assert sent_memory[0]["control_plane_tensor_bytes"] > 0
        assert [m["data_plane_bytes"] for m in memory.values()] == [m["data_plane_bytes"] for m in sent_memory.values()]
        handles[1][1].free()
        with pytest.raises(atoll.InvalidInput, match="was freed"):
            held.steps_async(handles[:2])
        assert held.steps_async([handles[0]])[0].result() > 0  # the job keeps serving
        with pytest.raises(atoll.NotFound, match="no live worker 'w99'"):
            client4.put(batches[0][0], worker="w99")
    finally:
        _free(handles)
        held.close()
        sent.close()
    ref_losses, ref_state = train_reference(model, batches, loss_fn, 2, "adamw", ADAMW)
    assert_matches_reference(losses, state, ref_losses, ref_state, rtol=1e-12)


def test_tensor_parallel_readers_each_read_a_held_batch_whole(client4):
    """Both tensor-parallel ranks of a stage read the whole batch: one holds it, the other pulls
    it each step; the steps are those on tensors, bit for bit."""
    jobs, batches = [], []
    for _ in range(2):
        model, batches, loss_fn = models.transformer()
        x, y = batches[0]
        jobs.append(
            client4.pipeline(
                model,
                example_input=x,
                example_target=y,
                loss_fn=loss_fn,
                microbatches=2,
                stages=2,
                tensor_parallel=2,
                optimizer_args={"lr": 0.1},
            )  # fmt: skip
        )
    held, sent = jobs
    handles = [held.put_batch(x, y) for x, y in batches]
    try:
        losses = [f.result() for f in held.steps_async(handles)]
        assert losses == [f.result() for f in sent.steps_async(batches)]
        state, sent_state = held.state_dict(), sent.state_dict()
        assert all(torch.equal(state[k], sent_state[k]) for k in state)
        assert all(m["control_plane_tensor_bytes"] == 0 for m in held.last.memory.values())
        with pytest.raises(atoll.InvalidInput, match="tensor-parallel job returns tensors, not remote values"):
            held.forward(handles[0][0], keep=True)  # its logits are joined from slices
    finally:
        _free(handles)
        held.close()
        sent.close()
