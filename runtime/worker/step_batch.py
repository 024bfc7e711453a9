"""A step's batch on a worker, as tensors: sent in the step's request (through the controller),
pulled from the holders of the remote values it names, or posted by the client to this worker
(``StepRequest.direct``: atoll.worker.inbox).

``WorkerService.RunSteps`` takes its steps' batches before its turn in the gang order, while the
steps before it still run: a tiny step's critical path goes through every worker's turn, one after
another, and decoding a batch there lengthened it. A batch that cannot be taken keeps the reason,
raised when its step runs, in its turn, as before."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from atoll._rpc import atoll_pb2 as pb
from atoll.core.wire import interleave, tensor_from_pb
from atoll.worker.inbox import BatchInbox


@dataclass(frozen=True, slots=True)
class StepBatch:
    inputs: list[torch.Tensor] | None = None
    targets: list[torch.Tensor] | None = None
    control_bytes: int = 0
    """Its bytes that came in the request (through the controller)."""
    pulled_bytes: int = 0
    """Its remote values' bytes that came from other workers (a value held here moves nothing)."""
    posted_bytes: int = 0
    error: Exception | None = None
    """Why it could not be taken: raised when its step runs."""


def take(
    request: pb.RunStepRequest,
    timeout_s: float,
    pull: Callable[[pb.RemoteRef, float, tuple[int, int]], torch.Tensor],
    inbox: BatchInbox,
    here: str,
) -> StepBatch:
    """Step ``request``'s batch; a posted one waits up to ``timeout_s`` in ``inbox``; ``here``:
    this worker's value-server address (the values it holds are read in place)."""
    control_bytes = sum(len(t.data) for t in (*request.inputs, *request.targets))
    try:
        # a data-parallel reader pulls its replica's rows alone, as it is sent its rows of a batch
        rows = (request.ref_replica, request.ref_replicas)  # (0, 0) outside data parallelism: all
        pulled_inputs = [pull(r, timeout_s, rows) for r in request.input_refs]
        pulled_targets = [pull(r, timeout_s, rows) for r in request.target_refs]
        refs = (*request.input_refs, *request.target_refs)
        pulled = sum(t.nbytes for r, t in zip(refs, (*pulled_inputs, *pulled_targets)) if r.address != here)
        posted_bytes = 0
        if request.direct:  # the client posted the rows here; the request names their specs
            posted = inbox.take(request.job_id, request.step, timeout_s).checked(request)
            sent_inputs, sent_targets, posted_bytes = posted.inputs, posted.targets, posted.nbytes
        else:
            sent_inputs = [tensor_from_pb(t, "input") for t in request.inputs]
            sent_targets = [tensor_from_pb(t, "target") for t in request.targets]
        inputs = interleave(sent_inputs, pulled_inputs, request.input_ref_at) or None
        targets = interleave(sent_targets, pulled_targets, request.target_ref_at) or None
    except Exception as e:
        return StepBatch(error=e)
    return StepBatch(inputs, targets, control_bytes, pulled, posted_bytes)
