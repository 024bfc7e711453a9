"""One thread that runs the steps of several jobs on this worker an action at a time, taking
whichever step's next action can run now: while one job's stage waits for a microbatch from its
neighbour (its pipeline bubble), another job's microbatch computes. The jobs attached to a
resident base run this way (their lanes, runtime/worker/service.py), so adapter jobs fill each
other's bubbles as the microbatches of mLoRA's one shared pipeline do.

Why one thread and not a thread per job: a worker's Python threads contend for the interpreter
lock on every small operation; measured here, two threads running 64-wide matmuls in one process
spent 38% more CPU per operation than one thread running them all, and adapter jobs on a small
Llama 33% more CPU per step when each ran in its own thread.

Among the steps whose next action can run, the one whose job has run the fewest actions per unit
of its ``weight`` (JobConfig.weight) goes first (stride scheduling, counted in actions): busy jobs
share the worker in proportion to their weights, as the controller's fair gate shares it between
steps of jobs that take turns. A step arriving starts level with the least served one, banking
nothing while it was away.

Each job's actions still run in its own order, and a job waits only for its own receives and
sends (``PipelineExecutor.interleavable``: no collective, whose peers would have to take the
jobs in the same order), so jobs interleaved differently on two workers cannot deadlock. A step
whose next action must wait has one wait running in a pool of threads blocked in the transport
(outside the interpreter lock), with the data plane's deadline: one per step, never one per
handle, so the pool (``MAX_STEPS`` threads) cannot fill with waits for sends that complete only
once a peer progresses while a wait that would let it queues. This thread sleeps until one of the
waits, or a new step, ends.
"""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from atoll.errors import InvalidInput
from atoll.worker.executor.run import StepRun

MAX_STEPS = 256
"""Steps interleaved on one worker at once (a lane runs one step at a time: jobs attached here)."""


@dataclass(eq=False)
class _Entry:
    run: StepRun
    finished: threading.Event = field(default_factory=threading.Event)
    waits: Future | None = None
    """The wait for the next action's handles, once started."""
    error: BaseException | None = None
    served: float = 0.0
    """Actions run, each counting 1 / the job's weight (the stride scheduler's pass)."""


class Interleaver:
    def __init__(self):
        self._cond = threading.Condition()
        self._entries: list[_Entry] = []
        self._arrived: Future = Future()
        self._thread: threading.Thread | None = None
        self._waits = ThreadPoolExecutor(max_workers=MAX_STEPS, thread_name_prefix="atoll-wait")

    def run(self, run: StepRun) -> None:
        """Run the step to its end among the others (the caller waits); raises what it raised."""
        entry = _Entry(run)
        with self._cond:
            if len(self._entries) >= MAX_STEPS:
                raise InvalidInput(f"this worker interleaves {MAX_STEPS} steps already; attach fewer jobs to its bases")
            entry.served = min((e.served for e in self._entries), default=0.0)
            self._entries.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="atoll-interleave", daemon=True)
                self._thread.start()
            if not self._arrived.done():
                self._arrived.set_result(None)
        entry.finished.wait()
        if entry.error is not None:
            raise entry.error

    def _loop(self) -> None:
        while True:
            with self._cond:
                entries, arrived = list(self._entries), self._arrived
            blocked: list[Future] = []
            ready: list[_Entry] = []
            for entry in entries:
                if entry.waits is None:
                    try:
                        entry.waits = self._wait_for(entry.run.next_waits(), entry.run.ex.timeout_s)
                    except BaseException as e:  # noqa: BLE001 (the step fails, the others go on)
                        self._end(entry, e)
                        continue
                if entry.waits.done():
                    ready.append(entry)
                else:
                    blocked.append(entry.waits)
            if ready:
                entry = min(ready, key=lambda e: e.served)
                entry.served += 1.0 / entry.run.ex.weight
                self._advance(entry)
            else:
                wait([*blocked, arrived], return_when=FIRST_COMPLETED)
                with self._cond:
                    if self._arrived.done():
                        self._arrived = Future()

    def _advance(self, entry: _Entry) -> None:
        """Run the entry's next action (its waits are over); end the entry when its step is done."""
        failed = entry.waits.exception()
        entry.waits = None
        try:
            if failed is not None:  # a receive or send of the step timed out or broke
                raise entry.run.failed(failed)
            if entry.run.advance():
                return
        except BaseException as e:  # noqa: BLE001 (handed to the step's caller)
            self._end(entry, e)
            return
        self._end(entry, None)

    def _end(self, entry: _Entry, error: BaseException | None) -> None:
        entry.error = error
        with self._cond:
            self._entries.remove(entry)
        entry.finished.set()

    def _wait_for(self, handles: list, timeout_s: float) -> Future:
        """Done once every handle is (at once if they are), or failed with the first one's error."""
        if all(getattr(h, "done", lambda: False)() for h in handles):
            waited: Future = Future()
            waited.set_result(None)
            return waited
        return self._waits.submit(_wait_all, handles, timeout_s)


def _wait_all(handles: list, timeout_s: float) -> None:
    for h in handles:
        h.wait(timeout_s)
