"""The client builds a step's request from its tensors' fields (atoll.core.wire.tensor_fields), so
that each TensorData is made inside the request rather than copied into it: the message must be
the one built from TensorData messages, byte for byte. No processes."""

import torch

from atoll._rpc import atoll_pb2 as pb
from atoll.client.job import _batch
from atoll.core.wire import tensor_from_pb, tensor_to_pb

TENSORS = [torch.randn(3, 4), torch.arange(5), torch.tensor(2.5, dtype=torch.float64), torch.zeros(0, 2)]


def test_a_steps_request_built_from_fields_is_the_one_built_from_messages():
    inputs, _, _ = _batch(TENSORS, "input")
    targets, _, _ = _batch(TENSORS[1], "target")
    built = pb.StepsRequest()
    for seq in (1, 2):
        built.steps.add(job_id="j", seq=seq, mode="train", inputs=inputs, targets=targets)
    made = pb.StepsRequest(
        steps=[
            pb.StepRequest(
                job_id="j",
                seq=seq,
                mode="train",
                inputs=[tensor_to_pb(t) for t in TENSORS],
                targets=[tensor_to_pb(TENSORS[1])],
            )
            for seq in (1, 2)
        ]
    )
    assert built == made and built.SerializeToString() == made.SerializeToString()
    for sent, tensor in zip(built.steps[1].inputs, TENSORS):
        assert torch.equal(tensor_from_pb(sent), tensor)


def test_a_single_step_request_takes_the_fields_too():
    inputs, _, _ = _batch(TENSORS[0], "input")
    request = pb.StepRequest(job_id="j", seq=3, mode="evaluate", inputs=inputs)
    assert request.inputs[0] == tensor_to_pb(TENSORS[0])
