"""Batches posted straight to this worker by a client (Worker.PostBatch), each waiting for the
step of its number (RunStepRequest.direct): the rows never pass through the controller.

A client posts a step's rows to each worker that reads them before it sends the step to the
controller, so they are normally here when the step runs; the step still waits for them with the
data-plane deadline. A batch whose step never runs (the controller refused it) is dropped once a
later step of its job has taken its own, or when the job is unloaded; at most ``MAX_WAITING``
batches of one job wait at once, so a client cannot fill the worker's memory.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from atoll.core.wire import TensorSpec, spec_of_pb_tensor
from atoll.errors import DeadlineExceeded, InvalidInput


@dataclass(frozen=True, slots=True)
class PostedBatch:
    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.inputs, *self.targets))

    def checked(self, request) -> PostedBatch:
        """Itself, if its tensors are those the step names (RunStepRequest.inputs and targets:
        the specs the controller checked against the job); InvalidInput otherwise."""
        for what, posted, named in (
            ("inputs", self.inputs, request.inputs),
            ("targets", self.targets, request.targets),
        ):
            got, want = [TensorSpec.of(t) for t in posted], [spec_of_pb_tensor(t) for t in named]
            if got != want:
                shown = ", ".join(map(str, got)) or "nothing"
                raise InvalidInput(
                    f"job {request.job_id} step {request.step}: the posted {what} are {shown}, "
                    f"the step sent to the controller named {', '.join(map(str, want)) or 'nothing'}"
                )
        return self


def check_reader(executor, request) -> None:
    """Refuse rows this worker would never take: inputs where none of its stages reads the batch,
    targets where it does not hold the last stage."""
    reads_inputs = any(executor.routes.batch_in(s) for s in executor.stages)
    reads_targets = executor.last_stage in executor.stages
    for what, sent, reads in (("inputs", request.inputs, reads_inputs), ("targets", request.targets, reads_targets)):
        if sent and not reads:
            raise InvalidInput(f"job {request.job_id}: this worker does not read the batch's {what} (see BatchRoute)")


class BatchInbox:
    MAX_WAITING = 256
    """Batches of one job posted and not yet taken (a client's steps in flight stay far below)."""

    def __init__(self):
        self._batches: dict[str, dict[int, PostedBatch]] = {}
        self._arrived = threading.Condition()

    def post(self, job_id: str, step: int, batch: PostedBatch) -> None:
        with self._arrived:
            waiting = self._batches.setdefault(job_id, {})
            if step in waiting:
                raise InvalidInput(f"job {job_id}: a batch for step {step} is already here")
            if len(waiting) >= self.MAX_WAITING:
                raise InvalidInput(
                    f"job {job_id}: {len(waiting)} posted batches wait for their steps already "
                    f"(steps {min(waiting)}..{max(waiting)}); send those steps first"
                )
            waiting[step] = batch
            self._arrived.notify_all()

    def take(self, job_id: str, step: int, timeout_s: float) -> PostedBatch:
        """Step ``step``'s batch, waiting up to ``timeout_s`` for it; the job's batches of earlier
        steps (refused, never to run) are dropped."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: step in self._batches.get(job_id, {}), timeout_s):
                raise DeadlineExceeded(
                    f"job {job_id} step {step}: its batch was not posted to this worker within {timeout_s:g} s "
                    f"(the client sends it with Worker.PostBatch before the step)"
                )
            waiting = self._batches[job_id]
            for stale in [s for s in waiting if s < step]:
                del waiting[stale]
            return waiting.pop(step)

    def drop(self, job_id: str) -> None:
        """The job is unloaded: its waiting batches go with it."""
        with self._arrived:
            self._batches.pop(job_id, None)

    def waiting(self, job_id: str) -> int:
        with self._arrived:
            return len(self._batches.get(job_id, {}))
