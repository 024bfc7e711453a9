"""The worker's end of a step channel (``Worker.StepChannel``): the controller's steps on one
long-lived gRPC stream instead of a unary call each (atoll.net.step_channel is the other end).

A unary call costs both ends its setup (the call, its metadata, its deadline, its status) on every
step; a message on an open stream does not. Each step still runs as a unary ``RunStep`` would
(``run``: its gang turn, its ledger), but in a pool thread of its own: a step waits there for its
turn, so the thread that reads the stream is never held by one, and the answers go back as the
steps end, each with the id the controller gave it."""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from atoll._rpc import atoll_pb2 as pb
from atoll.errors import AtollError
from atoll.net.relay import member_failure

log = logging.getLogger("atoll.worker.daemon")

_ENDED = object()


def failure(error: BaseException) -> pb.MemberResult:
    """A failed step's answer: its status code and words, as the unary ``RunStep`` would abort with
    (a bug logged with its traceback, as ``rpc_handler`` does)."""
    if not isinstance(error, AtollError):
        log.error("RunStep failed:\n%s", "".join(traceback.format_exception(error)))
    return member_failure(error, "RunStep")


class StepChannels:
    """The worker's step channels, and the pool their steps run in."""

    def __init__(self, run: Callable[[pb.RunStepRequest], pb.RunStepReply], threads: int = 32):
        self._run = run
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="atoll-channel-step")

    def serve(self, requests) -> Iterator[pb.ChannelAnswer]:
        """Answer every step that comes on ``requests`` until the controller closes its side (or
        the stream breaks), then the ones still running as they end."""
        answers: queue.SimpleQueue = queue.SimpleQueue()
        started = [0]  # read by this generator once the reader has put _ENDED

        def step(item: pb.ChannelStep) -> None:
            try:
                result = pb.MemberResult(reply=self._run(item.step))
            except Exception as e:  # noqa: BLE001 (each becomes its step's answer)
                result = failure(e)
            answers.put(pb.ChannelAnswer(id=item.id, result=result))

        def read() -> None:
            try:
                for item in requests:
                    self._pool.submit(step, item)
                    started[0] += 1
            except Exception:  # noqa: BLE001 (the stream broke: the controller fails its own waits)
                pass
            finally:
                answers.put(_ENDED)

        threading.Thread(target=read, name="atoll-step-channel", daemon=True).start()
        reading, answered = True, 0
        while reading or answered < started[0]:
            item = answers.get()
            if item is _ENDED:
                reading = False
                continue
            answered += 1
            yield item
