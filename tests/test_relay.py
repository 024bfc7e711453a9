"""Relayed dispatch: the tree's shape, and a step relayed through real gRPC servers (in this
process, each with its own port and the worker's Relay) down a tree of several levels.
"""

import json

import pytest

from atoll._rpc import atoll_pb2 as pb
from atoll._rpc import atoll_pb2_grpc as pb_grpc
from atoll.controller.cluster.dispatch import Call, Dispatcher, DispatchError, relay_tree
from atoll.controller.cluster.registry import WorkerRecord
from atoll.errors import InvalidInput, JobFailed
from atoll.net.relay import Relay, children
from atoll.net.rpc import make_server, rpc_handler

TOKEN = "relay-test-token"


@pytest.mark.parametrize("fanout", [2, 3, 8])
def test_relay_tree_tiles_the_ranks_with_at_most_fanout_children(fanout):
    for n in range(1, 80):
        sizes = relay_tree(n, fanout)
        members = [pb.GroupMember(subtree=s) for s in sizes]
        assert sizes[0] == n
        for start in range(n):  # every member's children tile its subtree
            spans = children(members[start : start + sizes[start]])
            assert len(spans) <= fanout
            assert sum(size for _, size in spans) == sizes[start] - 1
    depth = lambda sizes: 1 if sizes[0] == 1 else 1 + max(depth(sizes[s : s + z]) for s, z in children_of(sizes))  # noqa: E731
    assert depth(relay_tree(1024, 8)) <= 5  # log8(1024) + 1 rounded up, not a chain


def children_of(sizes):
    return children([pb.GroupMember(subtree=s) for s in sizes])


def test_malformed_subtree_sizes_are_refused():
    with pytest.raises(ValueError, match="claims a subtree of 5"):
        children([pb.GroupMember(subtree=3), pb.GroupMember(subtree=5), pb.GroupMember(subtree=1)])
    with pytest.raises(ValueError, match="root's subtree size 2 is not 3"):
        children([pb.GroupMember(subtree=2), pb.GroupMember(subtree=1), pb.GroupMember(subtree=1)])


class Member(pb_grpc.WorkerServicer):
    """A worker's control side with the real Relay; its own part echoes what it was asked."""

    def __init__(self, fail_step: bool = False):
        self.relay = Relay(TOKEN, self._own)
        self.fail_step = fail_step
        self.address = ""

    def _own(self, request):
        if self.fail_step:
            raise JobFailed(f"step {request.step} failed at {self.address}")
        seen = {
            "address": self.address,
            "gang_seq": request.gang_seq,
            "gang_floor": request.gang_floor,
            "inputs": len(request.inputs),
        }
        return pb.RunStepReply(memory_json=json.dumps(seen))

    @rpc_handler
    def RunStep(self, request, context):
        return self._own(request)

    @rpc_handler
    def RunStepGroup(self, request, context):
        return self.relay.run(request)


@pytest.fixture
def members():
    started = []

    def start(n, failing=()):
        for i in range(n):
            member = Member(fail_step=i in failing)
            server, port = make_server(TOKEN, "127.0.0.1", 0, max_workers=16)
            pb_grpc.add_WorkerServicer_to_server(member, server)
            server.start()
            member.address = f"127.0.0.1:{port}"
            started.append((server, member))
        return started

    yield start
    for server, member in started:
        server.stop(0)
        member.relay.close()


def _calls(started, common, own):
    calls = []
    for rank, (_, member) in enumerate(started):
        record = WorkerRecord(f"w{rank}", member.address, "cpu", "host", 0, "", endpoint=None)
        calls.append(Call(record, "RunStep", own.get(rank, common), gang_seq=100 + rank, gang_floor=50 + rank))
    return calls


@pytest.mark.timeout(60)
def test_a_step_relayed_down_three_levels_reaches_every_worker_once_with_its_own_request(members):
    started = members(13)
    dispatcher = Dispatcher(TOKEN, fanout=2)  # 13 workers, 2 children each: four levels
    try:
        common = pb.RunStepRequest(job_id="j", step=4, mode="train")
        first = pb.RunStepRequest(job_id="j", step=4, mode="train", inputs=[pb.TensorData(dtype="float32")])
        replies = dispatcher.relay(_calls(started, common, {0: first}), common, timeout_s=10).replies()
        # the next step to the same workers (whose members the dispatcher keeps): rank 12's own
        # request this time, and nothing left of rank 0's
        again = dispatcher.relay(_calls(started, common, {12: first}), common, timeout_s=10).replies()
    finally:
        dispatcher.close()
    seen = [json.loads(r.memory_json) for r in replies]
    assert [s["address"] for s in seen] == [m.address for _, m in started]  # rank order, each once
    assert [s["gang_seq"] for s in seen] == [100 + r for r in range(13)]
    assert [s["gang_floor"] for s in seen] == [50 + r for r in range(13)]
    assert [s["inputs"] for s in seen] == [1] + [0] * 12  # rank 0's own request, the others the common one
    assert [json.loads(r.memory_json)["inputs"] for r in again] == [0] * 12 + [1]


@pytest.mark.timeout(30)
def test_a_group_whose_gang_positions_do_not_match_its_members_is_refused(members):
    (_, member), *_ = members(1)
    group = pb.RunStepGroupRequest(
        common=pb.RunStepRequest(job_id="j"), members=[pb.GroupMember(subtree=1)], timeout_s=5, gang_seqs=[1, 2]
    )
    with pytest.raises(InvalidInput, match="2 gang positions and 0 floors for 1 members"):
        member.relay.run(group)


@pytest.mark.timeout(60)
def test_a_failure_deep_in_the_tree_names_the_failing_worker(members):
    started = members(13, failing={11})
    dispatcher = Dispatcher(TOKEN, fanout=2)
    try:
        common = pb.RunStepRequest(job_id="j", step=4, mode="train")
        with pytest.raises(DispatchError, match="worker w11 .*step 4 failed at") as err:
            dispatcher.relay(_calls(started, common, {}), common, timeout_s=10).replies()
        assert isinstance(err.value.error, JobFailed)

        assert relay_tree(13, 2)[7] == 6  # rank 7 relays to ranks 8..12
        started[7][0].stop(0)  # that relaying worker is gone: it is the one named
        with pytest.raises(DispatchError, match="worker w7 .*unreachable"):
            dispatcher.relay(_calls(started, common, {}), common, timeout_s=10).replies()
    finally:
        dispatcher.close()
