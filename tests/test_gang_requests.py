"""The controller writes each worker's part of a step straight into that worker's request
(controller/gang.py ``_fill``, ``_steps_calls``) rather than building it and copying it in: the
requests must be those built the plain way, from protobuf constructors, byte for byte, for a
data-parallel pipeline whose readers each take their replica's rows, with remote values among
the inputs and targets. No processes."""

from types import SimpleNamespace

import torch

from atoll._rpc import atoll_pb2 as pb
from atoll.controller.compiler.topology import Topology
from atoll.controller.gang import _batch_readers, _step_requests, _steps_calls
from atoll.core.wire import shard_rows, tensor_from_pb, tensor_to_pb


def _job():
    topology = Topology(ranks=3, microbatches=2, data_parallel=2)  # 6 workers; rank 0 reads the inputs
    compiled = SimpleNamespace(topology=topology, batch_ranks=[0])
    return SimpleNamespace(job_id="j", workers=[f"w{i}" for i in range(6)], compiled=compiled)


def _request(seq: int, **fields) -> pb.StepRequest:
    return pb.StepRequest(
        job_id="j",
        seq=seq,
        inputs=[tensor_to_pb(torch.randn(4, 3)), tensor_to_pb(torch.arange(8).reshape(4, 2))],
        targets=[tensor_to_pb(torch.randn(4))],
        **fields,
    )


def _plain(job, seq, request, mode, input_refs, target_refs):
    """Each worker's request built the plain way (the controller's before it wrote them in place)."""
    replicas = job.compiled.topology.data_parallel
    own = {}
    for index, d, inputs, targets in _batch_readers(job):
        pulls = (inputs and input_refs) or (targets and target_refs)  # it keeps its replica's rows of them
        own[index] = pb.RunStepRequest(
            ref_replica=d if pulls else 0,
            ref_replicas=replicas if pulls else 0,
            job_id=job.job_id,
            step=seq,
            inputs=[shard_rows(t, d, replicas) for t in request.inputs] if inputs else [],
            targets=[shard_rows(t, d, replicas) for t in request.targets] if targets else [],
            input_refs=input_refs if inputs else [],
            target_refs=target_refs if targets else [],
            input_ref_at=request.input_ref_at if inputs else [],
            target_ref_at=request.target_ref_at if targets else [],
            keep_outputs=request.keep_outputs and targets,
            mode=mode,
            direct=request.direct,
        )
    return own, pb.RunStepRequest(job_id=job.job_id, step=seq, mode=mode)


def test_a_step_written_in_place_is_the_one_built_from_constructors():
    job = _job()
    refs = [pb.RemoteRef(value_id="v1", worker_id="w0", address="a:1")]
    request = _request(5, mode="forward", keep_outputs=True, input_ref_at=[1], target_ref_at=[0])
    own, common = _step_requests(job, 5, request, "forward", refs, refs)
    plain_own, plain_common = _plain(job, 5, request, "forward", refs, refs)
    assert sorted(own) == sorted(plain_own) == [0, 2, 3, 5]  # each replica's first and last rank
    for index in own:
        assert own[index].SerializeToString() == plain_own[index].SerializeToString()
    assert common.SerializeToString() == plain_common.SerializeToString()
    rows = tensor_from_pb(own[3].inputs[0])  # replica 1 reads the last two rows
    assert torch.equal(rows, tensor_from_pb(request.inputs[0])[2:])
    assert (own[3].ref_replica, own[3].ref_replicas) == (1, 2)  # and keeps rows 1/2 of what it pulls


def test_a_calls_steps_written_in_place_are_the_ones_built_from_constructors():
    job = _job()
    ref = pb.RemoteRef(value_id="v1", worker_id="w0", address="a:1")
    requests = [_request(7), _request(8, direct=True), _request(9, target_ref_at=[1])]
    modes, refs = ["train", "evaluate", "train"], [([], []), ([], []), ([], [ref])]  # a remote target
    calls = _steps_calls(job, 7, requests, modes, refs)
    for index, call in enumerate(calls):
        steps = []
        for seq, (request, mode, step_refs) in enumerate(zip(requests, modes, refs), start=7):
            own, common = _plain(job, seq, request, mode, *step_refs)
            steps.append(own.get(index, common))
        assert call.SerializeToString() == pb.RunStepsRequest(steps=steps).SerializeToString()
    assert len(calls[1].steps) == 3 and not calls[1].steps[0].inputs  # a middle rank reads no batch
    assert list(calls[2].steps[2].target_refs) == [ref] and not calls[0].steps[2].target_refs  # the last rank reads it
