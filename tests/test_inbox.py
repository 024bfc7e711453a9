"""The worker's inbox of posted batches (runtime/worker/inbox.py): pure logic, no processes."""

import threading

import pytest
import torch

from atoll.errors import DeadlineExceeded, InvalidInput
from atoll.worker.inbox import BatchInbox, PostedBatch


def _batch(value: float = 0.0) -> PostedBatch:
    return PostedBatch([torch.full((2, 3), float(value))], [torch.zeros(2)])


def test_a_step_takes_its_own_batch_and_drops_the_earlier_ones_that_never_ran():
    inbox = BatchInbox()
    for step in (1, 2, 3):
        inbox.post("job", step, _batch(step))
    inbox.post("other", 1, _batch())
    assert inbox.take("job", 2, timeout_s=1.0).inputs[0][0, 0] == 2.0
    assert inbox.waiting("job") == 1 and inbox.waiting("other") == 1  # step 1 of "job" will never run
    assert inbox.take("job", 3, timeout_s=1.0).nbytes == 2 * 3 * 4 + 2 * 4
    with pytest.raises(InvalidInput, match="already here"):
        inbox.post("other", 1, _batch())
    inbox.drop("other")
    assert inbox.waiting("other") == 0


def test_a_step_waits_for_its_batch_with_a_deadline():
    inbox = BatchInbox()
    threading.Timer(0.1, inbox.post, args=("job", 1, _batch(7.0))).start()
    assert inbox.take("job", 1, timeout_s=10.0).inputs[0][0, 0] == 7.0
    with pytest.raises(DeadlineExceeded, match="step 2: its batch was not posted to this worker within 0.05 s"):
        inbox.take("job", 2, timeout_s=0.05)


def test_a_client_cannot_pile_up_batches_without_steps():
    inbox = BatchInbox()
    for step in range(1, BatchInbox.MAX_WAITING + 1):
        inbox.post("job", step, _batch())
    with pytest.raises(InvalidInput, match=r"posted batches wait for their steps already \(steps 1\.\.256\)"):
        inbox.post("job", BatchInbox.MAX_WAITING + 1, _batch())


def test_posted_tensors_must_be_those_the_step_names():
    from atoll._rpc import atoll_pb2 as pb

    batch = _batch()
    named = pb.RunStepRequest(job_id="job", step=4, inputs=[pb.TensorData(dtype="float32", shape=[2, 3])],
                              targets=[pb.TensorData(dtype="float32", shape=[2])])  # fmt: skip
    assert batch.checked(named) is batch
    del named.inputs[:]
    named.inputs.append(pb.TensorData(dtype="float64", shape=[2, 3]))
    with pytest.raises(InvalidInput, match=r"the posted inputs are float32\[2, 3\], the step .* named float64\[2, 3\]"):
        batch.checked(named)
