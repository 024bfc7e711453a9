"""Parallel dispatch: one call to every worker of a job at once, directly or relayed.

Downstream workers wait on their data-plane receives, not on the controller, so all ranks must
be called together; a rank called late would only leave its peers waiting. Calls go out on one
asyncio loop (atoll.net.rpc.AsyncCalls), not a thread each, so any number can be in flight.

A gRPC call costs the caller far more than building its message (about 0.5 ms of CPU on a
small machine), so sending a step to n workers directly costs the controller n calls. Relayed
dispatch sends it as one call to the root of a tree of the job's workers (``RELAY_FANOUT``
children per worker, in rank order, preorder), and every worker relays to its children
(runtime/net/relay.py): the controller's calls per step stay at one, each worker makes at most
``RELAY_FANOUT``, and a step reaches every worker after about log_fanout(n) hops.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass

from atoll._rpc import atoll_pb2 as pb
from atoll._rpc import atoll_pb2_grpc as pb_grpc
from atoll.controller.cluster.registry import WorkerRecord
from atoll.errors import AtollError
from atoll.net.relay import RELAY_MARGIN_S, in_thread, member_error
from atoll.net.rpc import AsyncCalls
from atoll.net.step_channel import StepChannel

RELAY_ABOVE_WORKERS = 16
"""Above this many workers, "parallel" dispatch relays a step through a tree of them."""
RELAY_FANOUT = 8


@dataclass(slots=True)
class Call:
    worker: WorkerRecord
    method: str
    request: object
    """May be shared by several calls of one dispatch (a step's common request)."""
    gang_seq: int = 0
    """The worker's gang position for this call (0: unordered), set when dispatched."""
    gang_floor: int = 0
    """Positions of the worker below this one whose calls have ended (controller/jobs.py, GangScheduler)."""
    gang_lane: str = ""
    """The order the position is in: the worker's common one (""), or a job's own (``Job.lane``)."""


class DispatchError(AtollError):
    def __init__(self, worker: WorkerRecord, error: AtollError):
        super().__init__(f"{worker.describe()}: {error}")
        self.worker = worker
        self.error = error
        self.code = error.code


@functools.lru_cache(maxsize=256)
def relay_tree(workers: int, fanout: int = RELAY_FANOUT) -> tuple[int, ...]:
    """Subtree sizes of a tree over ranks 0..workers-1 in preorder (rank order): rank 0 is the
    root, and the ranks after a worker are split into at most ``fanout`` contiguous subtrees of
    near-equal size."""
    sizes = [0] * workers
    todo = [(0, workers)]
    while todo:
        start, size = todo.pop()
        sizes[start] = size
        rest, pos = size - 1, start + 1
        k = min(fanout, rest)
        for i in range(k):
            part = rest // k + (i < rest % k)
            todo.append((pos, part))
            pos += part
    return tuple(sizes)  # cached: a job's every step uses the same tree


class Pending:
    """The replies of one dispatch, in call order: ``replies()`` waits for all of them, or
    raises the first failure (``DispatchError``, naming the worker) as soon as it is known."""

    def __init__(self, calls: list[Call], futures: list[Future]):
        self.calls = calls
        self._futures = futures

    def on_end(self, callback) -> None:
        """Call ``callback(calls)`` with the calls that have ended, failed or not, as they end
        (each on its own here; a relayed dispatch's all at once)."""
        for call, future in zip(self.calls, self._futures):
            future.add_done_callback(lambda _, calls=[call]: callback(calls))

    def settle(self) -> Pending:
        """Wait until every call has ended, failed or not (each has its own deadline)."""
        wait(self._futures)
        return self

    def replies(self) -> list:
        done, _ = wait(self._futures, return_when=FIRST_EXCEPTION)
        for call, future in zip(self.calls, self._futures):
            if future in done and future.exception() is not None:
                raise DispatchError(call.worker, future.exception())
        return [f.result() for f in self._futures]


class RelayedPending(Pending):
    """One call to the tree's root, answered with every member's result in rank order."""

    def __init__(self, calls: list[Call], root: Future):
        super().__init__(calls, [root])

    def on_end(self, callback) -> None:
        self._futures[0].add_done_callback(lambda _: callback(self.calls))

    def replies(self) -> list:
        try:
            results = self._futures[0].result().results
        except AtollError as e:  # the root failed or could not be reached: nothing was relayed
            raise DispatchError(self.calls[0].worker, e) from None
        if len(results) != len(self.calls):
            raise DispatchError(
                self.calls[0].worker, AtollError(f"relay answered for {len(results)} of {len(self.calls)} workers")
            )
        failed = [i for i, r in enumerate(results) if r.code]
        if failed:  # a member's own failure, rather than the abandonment it caused
            i = next((i for i in failed if not results[i].abandoned), failed[0])
            raise DispatchError(self.calls[i].worker, member_error(results[i]))
        return [r.reply for r in results]


def _requests(calls: list[Call]) -> list:
    """Each call's request with its gang position; a request shared by several calls is copied."""
    shared = collections.Counter(id(c.request) for c in calls)
    out = []
    for c in calls:
        request = c.request
        if c.gang_seq:
            if shared[id(request)] > 1:
                request = type(request)()
                request.CopyFrom(c.request)
            request.gang_seq, request.gang_floor = c.gang_seq, c.gang_floor
        out.append(request)
    return out


class Dispatcher:
    def __init__(self, token: str, fanout: int = RELAY_FANOUT, controller_key: str = ""):
        self._calls = AsyncCalls(token, pb_grpc.WorkerStub, controller_key, step_channel=StepChannel)
        self.fanout = fanout
        self._loading: collections.Counter[str] = collections.Counter()
        """Per worker id, its LoadPlan calls in flight (counted from two threads: under the lock)."""
        self._loading_lock = threading.Lock()
        self._members = functools.lru_cache(maxsize=64)(self._build_members)

    def loading(self, worker: WorkerRecord) -> bool:
        """Whether a plan is on its way to ``worker`` or being loaded there: a large one keeps the
        worker (deserializing it) and the controller (sending it) too busy for heartbeats, so its
        silence then is no death; the load's own deadline bounds it (Registry.sweep)."""
        return self._loading[worker.worker_id] > 0

    def submit(self, calls: list[Call], timeout_s: float) -> Pending:
        """Send every call now; returns at once."""
        futures = [self._calls.call(c.worker.address, c.method, r, timeout_s) for c, r in zip(calls, _requests(calls))]
        for call, future in zip(calls, futures):
            if call.method == "LoadPlan":
                with self._loading_lock:
                    self._loading[call.worker.worker_id] += 1
                future.add_done_callback(functools.partial(self._loaded, call.worker))
        return Pending(calls, futures)

    def _loaded(self, worker: WorkerRecord, future: Future) -> None:
        with self._loading_lock:
            self._loading[worker.worker_id] -= 1
        if not future.cancelled() and future.exception() is None:  # its answer: alive as of now
            worker.last_heartbeat = time.monotonic()

    def relay(self, calls: list[Call], common: pb.RunStepRequest, timeout_s: float) -> Pending:
        """Send a step (``RunStep`` calls in rank order, whose requests are ``common`` or their
        own) through a relay tree of its workers; returns at once."""
        request = pb.RunStepGroupRequest()
        request.CopyFrom(self._members(tuple(c.worker.address for c in calls)))
        request.common.CopyFrom(common)
        request.timeout_s = timeout_s
        request.gang_seqs.extend([c.gang_seq for c in calls])
        request.gang_floors.extend([c.gang_floor for c in calls])
        for i, c in enumerate(calls):
            if c.request is not common:  # the few ranks that read the batch
                request.members[i].own.CopyFrom(c.request)
        # every level of the tree may take its margin
        deadline = timeout_s + RELAY_MARGIN_S * len(calls).bit_length()
        return RelayedPending(calls, self._calls.call(calls[0].worker.address, "RunStepGroup", request, deadline))

    def _build_members(self, addresses: tuple[str, ...]) -> pb.RunStepGroupRequest:
        """The members of a relayed step to these workers, the same every step of a job: built
        once (a thousand of them cost the controller milliseconds to build, a copy microseconds)."""
        sizes = relay_tree(len(addresses), self.fanout)
        return pb.RunStepGroupRequest(
            members=[pb.GroupMember(address=a, subtree=size) for a, size in zip(addresses, sizes)]
        )

    def sequential(self, calls: list[Call], timeout_s: float) -> Pending:
        """Send each call (a step: ``RunStep``) only once the previous one's worker reports that
        the step has started there; returns at once after the last has started. For measuring
        what parallel dispatch saves; a rank cannot wait for the next one's start, since it
        would block on its sends to it."""
        futures: list[Future] = []
        for call, request in zip(calls, _requests(calls)):
            stream = call.worker.endpoint.stream(f"{call.method}Stream", request, timeout_s)
            try:
                next(stream)
            except AtollError as e:
                futures.append(Future())
                futures[-1].set_exception(e)
                continue  # the later calls still go: their gang positions are taken
            futures.append(in_thread(lambda s: next(s).reply, stream))
        return Pending(calls, futures)

    STEP_METHODS = frozenset({"RunStep", "RunSteps", "RunStepGroup"})

    def abandon(self, worker: WorkerRecord, error: AtollError) -> int:
        """End the step calls in flight to ``worker`` now with ``error`` (it was declared dead).
        Other calls keep their deadlines: a worker parsing a large plan may miss its heartbeats
        and yet finish the load."""
        return self._calls.abandon(worker.address, self.STEP_METHODS, error)

    def each(self, calls: list[Call], timeout_s: float) -> list[AtollError | object]:
        """Replies or errors in call order, waiting for all (for cleanup, where failures are expected)."""
        futures = self.submit(calls, timeout_s)._futures
        return [f.exception() or f.result() for f in futures]

    def close(self) -> None:
        self._calls.close()
