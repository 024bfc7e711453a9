"""A worker's memory of one job's steps: which numbers it has received, their replies, and how
far it got, so that a step sent twice runs once.

A step is sent twice when the controller restarts under it: the client sends its unanswered steps
again (``StepRequest.retry``) and the restarted controller sends them to the workers again. A
worker that has the step's reply answers with it; one whose run of the step is still going (its
peer never got the step, say, and it waits in the data plane) answers once that run ends; one that
never received it runs it. When it registers again, the worker reports how far the job got here
(``HeldJob``), from which the controller numbers what comes next (controller/recovery.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from atoll._rpc import atoll_pb2 as pb
from atoll.errors import DeadlineExceeded, InvalidInput

KEPT_REPLIES = 64
"""Replies kept per job: more than the steps a client keeps in flight (4 calls of up to 16 steps)."""
KEPT_OUTPUT_BYTES = 64 << 20
"""Forward steps' outputs kept per job at most: older replies go first beyond it."""


class StepLedger:
    def __init__(self, namespace: str):
        self.namespace = namespace
        """The data-plane namespace of this load of the job (a load again makes a new ledger)."""
        self._replies: OrderedDict[int, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._output_bytes: dict[int, int] = {}
        self.last_step = 0
        self.last_done = 0
        self.train_steps = 0

    def claim(self, step: int) -> Future | None:
        """None: step ``step`` is new here and the caller runs it, then ``settle``s it. Otherwise
        the future of its earlier run (done, or done when that run ends)."""
        with self._lock:
            earlier = self._replies.get(step)
            if earlier is not None or step == 0:  # 0: an unnumbered step, never sent twice
                return earlier
            if step <= self.last_step:
                raise InvalidInput(
                    f"step {step} already ran on this worker and its reply is no longer kept "
                    f"(the last {KEPT_REPLIES} are)"
                )
            self.last_step = step
            self._replies[step] = Future()
            while len(self._replies) > KEPT_REPLIES:
                self._output_bytes.pop(self._replies.popitem(last=False)[0], None)
        return None

    def settle(self, step: int, mode: str, run: Callable[[], pb.RunStepReply]) -> pb.RunStepReply:
        """Run a claimed step and keep its reply (or its error) for a second sending."""
        with self._lock:
            future = self._replies.get(step) if step else None
        try:
            reply = run()
        except BaseException as e:
            if future is not None:
                future.set_exception(e)
            raise
        with self._lock:
            self.last_done = max(self.last_done, step)
            self.train_steps += mode == "train"
            if future is not None and reply.outputs:
                self._output_bytes[step] = sum(len(t.data) for t in reply.outputs)
                while sum(self._output_bytes.values()) > KEPT_OUTPUT_BYTES:
                    self._replies.pop(min(self._output_bytes), None)  # a second sending gets "no longer kept"
                    del self._output_bytes[min(self._output_bytes)]
        if future is not None:
            future.set_result(reply)
        return reply

    def run(self, step: int, mode: str, run: Callable[[], pb.RunStepReply], wait_s: float) -> pb.RunStepReply:
        """Step ``step``'s reply: its earlier run's, or ``run()``'s if it is new here."""
        earlier = self.claim(step)
        if earlier is None:
            return self.settle(step, mode, run)
        return self.earlier(step, earlier, wait_s)

    @staticmethod
    def earlier(step: int, future: Future, wait_s: float) -> pb.RunStepReply:
        """The reply of a step's earlier run, waiting up to ``wait_s`` for a run still going."""
        try:
            return future.result(timeout=wait_s)
        except FutureTimeout:
            raise DeadlineExceeded(f"step {step}: its earlier run here did not end within {wait_s:g} s") from None

    def abandon(self, steps: list[int], error: BaseException) -> None:
        """Claimed steps that will not run (an earlier step of their call failed) end with ``error``."""
        with self._lock:
            for step in steps:
                future = self._replies.get(step)
                if future is not None and not future.done():
                    future.set_exception(error)

    def held(self, job_id: str) -> pb.HeldJob:
        with self._lock:
            return pb.HeldJob(
                job_id=job_id,
                namespace=self.namespace,
                last_step=self.last_step,
                last_done=self.last_done,
                train_steps=self.train_steps,
            )
