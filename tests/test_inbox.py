"""The worker's inbox of posted batches (runtime/worker/inbox.py) and the client's fallback: no processes."""

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


def test_a_client_that_cannot_reach_a_reader_sends_its_batches_through_the_controller():
    """A worker the client cannot reach (here: nothing listens) fails the post at once; the step
    then goes through the controller, and the job stops posting (no wait for a connection per step)."""
    from atoll._rpc import atoll_pb2 as pb
    from atoll.client.direct import BatchPoster
    from atoll.core.wire import tensor_to_pb

    class Client:  # the parts of atoll.Client a poster uses
        _token, _tls, routes_asked = "token", None, 0

        class _endpoint:
            default_timeout_s = 10.0

        def _call(self, method, request):
            self.routes_asked += 1
            reader = pb.BatchReader(address="127.0.0.1:1", replica=0, replicas=1, inputs=True, targets=True)
            return pb.BatchRouteReply(readers=[reader])

    client = Client()
    poster = BatchPoster(client, "job")
    batch = [tensor_to_pb(torch.zeros(2, 3))]
    assert poster.post(1, batch, batch) is False and poster.post(2, batch, batch) is False
    assert client.routes_asked == 1  # the second step did not try again
    poster.close()
