"""Relayed dispatch, the worker's side (``RunStepGroup``). The request is a subtree of the job's
workers in preorder (each member with the size of its own subtree), rooted at this worker: run
this worker's own part, and hand each child's subtree to that child (``RunStepGroup``, or
``RunStep`` for a leaf), all at once. Answer with one result per member once all have answered,
or at the first failure (the unfinished ones are then reported abandoned; their calls still end
on their own deadlines). The controller's side, and the tree's shape, are in
``atoll.controller.cluster.dispatch``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, wait

import grpc

from atoll._rpc import atoll_pb2 as pb
from atoll._rpc import atoll_pb2_grpc as pb_grpc
from atoll.errors import AtollError, InvalidInput, from_status
from atoll.net.rpc import AsyncCalls

# a subtree answers after its members' deadlines; each level of relaying gets this much more
RELAY_MARGIN_S = 10.0


def member_request(group: pb.RunStepGroupRequest, index: int) -> pb.RunStepRequest:
    member = group.members[index]
    request = pb.RunStepRequest()
    request.CopyFrom(member.own if member.HasField("own") else group.common)
    request.gang_seq, request.gang_floor = group.gang_seqs[index], group.gang_floors[index]
    return request


def subgroup(group: pb.RunStepGroupRequest, start: int, size: int) -> pb.RunStepGroupRequest:
    """The members ``start .. start + size - 1`` (a child's subtree) as a group of their own."""
    end = start + size
    return pb.RunStepGroupRequest(
        common=group.common,
        members=group.members[start:end],
        timeout_s=group.timeout_s,
        gang_seqs=group.gang_seqs[start:end],
        gang_floors=group.gang_floors[start:end],
    )


def children(members) -> list[tuple[int, int]]:
    """(start, size) of each child subtree of members[0]; ValueError if the sizes do not tile."""
    if not members or members[0].subtree != len(members):
        raise ValueError(f"the root's subtree size {members[0].subtree if members else 0} is not {len(members)}")
    spans, start = [], 1
    while start < len(members):
        size = members[start].subtree
        if size < 1 or start + size > len(members):
            raise ValueError(f"member {start} claims a subtree of {size} of the {len(members)} members")
        spans.append((start, size))
        start += size
    return spans


def in_thread(fn: Callable, arg) -> Future:
    """Run ``fn(arg)`` in a thread of its own: a bounded pool could fill with steps waiting for
    their gang turn behind one that has no thread yet."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(arg))
        except BaseException as e:  # noqa: BLE001 - every failure becomes the member's result
            future.set_exception(e)

    threading.Thread(target=run, name="relay-own", daemon=True).start()
    return future


_ABANDONED = pb.MemberResult(abandoned=True, code=grpc.StatusCode.ABORTED.value[0], error="abandoned")


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def member_failure(error: BaseException, what: str = "") -> pb.MemberResult:
    """A failed member's result: an atoll error's code and words; anything else (a bug) INTERNAL,
    prefixed ``what: `` as ``rpc_handler`` reports a unary call's bug."""
    if isinstance(error, AtollError):
        return pb.MemberResult(code=error.code.value[0], error=str(error))
    prefix = f"{what}: " if what else ""
    return pb.MemberResult(code=grpc.StatusCode.INTERNAL.value[0], error=f"{prefix}{type(error).__name__}: {error}")


def member_error(result: pb.MemberResult) -> AtollError:
    """The error a failed member's result carries (``member_failure`` read back)."""
    return from_status(_CODES.get(result.code, grpc.StatusCode.UNKNOWN), result.error)


def _results(future: Future, size: int) -> list[pb.MemberResult]:
    """The results of one child subtree of ``size`` members (or of this worker's own part)."""
    if not future.done():
        return [_ABANDONED] * size
    error = future.exception()
    if error is not None:  # the subtree's root failed, or could not be reached: nothing below ran through it
        return [member_failure(error)] + [_ABANDONED] * (size - 1)
    reply = future.result()
    if isinstance(reply, pb.RunStepGroupReply):
        if len(reply.results) != size:
            wrong = AtollError(f"a relay answered for {len(reply.results)} of its {size} members")
            return [member_failure(wrong)] + [_ABANDONED] * (size - 1)
        return list(reply.results)
    return [pb.MemberResult(reply=reply)]


class Relay:
    def __init__(self, token: str, run_own: Callable[[pb.RunStepRequest], pb.RunStepReply]):
        self._run_own = run_own
        self._calls = AsyncCalls(token, pb_grpc.WorkerStub)

    def use_controller_key(self, key: str) -> None:
        """Relay with the key of the controller this worker registered with (runtime/worker/daemon.py)."""
        self._calls.use_controller_key(key)

    def run(self, group: pb.RunStepGroupRequest) -> pb.RunStepGroupReply:
        try:
            spans = children(group.members)
        except ValueError as e:
            raise InvalidInput(f"malformed step group: {e}") from None
        if group.timeout_s <= 0:
            raise InvalidInput("a step group needs a positive timeout_s")
        if not len(group.gang_seqs) == len(group.gang_floors) == len(group.members):
            raise InvalidInput(
                f"malformed step group: {len(group.gang_seqs)} gang positions and {len(group.gang_floors)} "
                f"floors for {len(group.members)} members"
            )
        futures = [in_thread(self._run_own, member_request(group, 0))]
        for start, size in spans:
            head = group.members[start]
            if size == 1:
                futures.append(self._calls.call(head.address, "RunStep", member_request(group, start), group.timeout_s))
            else:
                sub = subgroup(group, start, size)
                futures.append(self._calls.call(head.address, "RunStepGroup", sub, group.timeout_s + RELAY_MARGIN_S))
        wait(futures, timeout=group.timeout_s + RELAY_MARGIN_S, return_when=FIRST_EXCEPTION)
        results = _results(futures[0], 1)
        for future, (_, size) in zip(futures[1:], spans):
            results += _results(future, size)
        return pb.RunStepGroupReply(results=results)

    def close(self) -> None:
        self._calls.close()
