"""atoll.net.chunked: a message crosses as pieces, its large bytes fields lifted out and sent beside
it (so protobuf's 2 GiB limit applies to the rest only), and comes back whole; pieces that do
not add up are refused with the reason."""

import pytest

from atoll._rpc import atoll_pb2 as pb
from atoll.errors import InvalidInput
from atoll.net import chunked


@pytest.fixture()
def small_pieces(monkeypatch):
    monkeypatch.setattr(chunked, "LIFT_BYTES", 100)
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 64)


def _plan() -> pb.LoadPlanRequest:
    request = pb.LoadPlanRequest(job_id="job1", num_stages=3, loss_program=b"L" * 500)
    request.stages.add(stage=0, exported_program=b"a" * 300)
    request.stages.add(stage=1, exported_program=b"small")
    request.stages.add(stage=2, exported_program=b"c" * 1000)
    return request


def test_a_message_without_large_fields_crosses_whole(small_pieces):
    request = pb.LoadPlanRequest(job_id="job1", loss_program=b"L" * 100)
    (head, *rest) = chunked.pieces("LoadPlan", request)
    assert list(head.sizes) == [request.ByteSize()] and not head.paths and rest
    assert chunked.parse(pb.LoadPlanRequest, *chunked.assemble(iter([head, *rest])), "LoadPlan") == request


def test_large_fields_travel_beside_the_message_and_come_back_in_place(small_pieces):
    request = _plan()
    sent = list(chunked.pieces("LoadPlan", request))
    assert request == _plan()  # the caller's message is left as it was
    head = sent[0]
    assert head.method == "LoadPlan" and len(head.paths) == 3  # loss program and two stage programs
    assert head.sizes[0] < 100 and sorted(head.sizes[1:]) == [300, 500, 1000]
    assert all(len(c.data) <= 64 for c in sent)
    got_head, data = chunked.assemble(iter(sent))
    assert chunked.parse(pb.LoadPlanRequest, got_head, data, "LoadPlan") == request
    # keep=False (a message built for one call): the same pieces, the large fields left out after
    consumed = _plan()
    assert list(chunked.pieces("LoadPlan", consumed, keep=False)) == sent
    assert not consumed.loss_program and not consumed.stages[0].exported_program
    assert consumed.stages[1].exported_program == b"small" and consumed.job_id == "job1"


def test_pieces_that_do_not_add_up_are_refused(small_pieces):
    head, data = chunked.assemble(iter(chunked.pieces("LoadPlan", _plan())))
    with pytest.raises(InvalidInput, match="do not add up"):
        chunked.parse(pb.LoadPlanRequest, head, data[:-1], "LoadPlan")
    wrong = pb.Chunk()
    wrong.CopyFrom(head)
    wrong.paths[0] = '[["no_such_field", -1]]'
    with pytest.raises(InvalidInput, match="no bytes field at"):
        chunked.parse(pb.LoadPlanRequest, wrong, data, "LoadPlan")
    with pytest.raises(InvalidInput, match="not a chunked method"):
        chunked.message_types("Worker", "RunStep")


def test_pieces_cut_across_the_parts_still_come_back_whole(small_pieces):
    """``pieces`` cuts each part on its own and ``assemble`` joins each from its own pieces; pieces
    cut any other way (another sender) are put together whole and cut by the announced sizes."""
    request = _plan()
    sent = list(chunked.pieces("LoadPlan", request))
    payload = b"".join(c.data for c in sent)
    recut = [pb.Chunk(data=payload[i : i + 50]) for i in range(0, len(payload), 50)]
    recut[0].MergeFrom(pb.Chunk(method=sent[0].method, sizes=sent[0].sizes, paths=sent[0].paths))
    head, parts = chunked.assemble(iter(recut))
    assert [len(p) for p in parts] == list(head.sizes)
    assert chunked.parse(pb.LoadPlanRequest, head, parts, "LoadPlan") == request
    with pytest.raises(InvalidInput, match="do not add up"):  # a piece short
        chunked.parse(pb.LoadPlanRequest, *chunked.assemble(iter(recut[:-1])), "LoadPlan")
