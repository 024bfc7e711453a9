"""A job on the cluster as the client holds it: Job (steps, evaluation, timelines, weights,
checkpoints) and the futures and results of its steps."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from atoll._rpc import atoll_pb2 as pb
from atoll.client.calls import StepCall
from atoll.client.direct import BatchPoster, specs_only
from atoll.client.export import as_leaves
from atoll.client.plan import Plan
from atoll.client.remote import RemoteValue
from atoll.client.trace import Trace
from atoll.core.wire import tensor_fields, tensor_from_pb
from atoll.errors import InvalidInput, JobFailed

if TYPE_CHECKING:  # the client module imports this one: Job only holds the Client it came from
    from atoll.client.client import Client


@dataclass(frozen=True, slots=True)
class StepResult:
    loss: float
    """Mean of the per-microbatch losses."""
    microbatch_losses: tuple[float, ...]
    step: int
    """The step's number: 1 for the job's first step, in the order steps were sent."""
    memory: dict[int, dict]
    """Per rank, the worker's measured accounting: peak bytes by category and peak stashed microbatches."""
    mode: str = "train"
    """"train", "evaluate" or "forward" (see Job.evaluate, Job.forward)."""
    outputs: tuple[torch.Tensor, ...] = ()
    """Forward steps: the last stage's output for the full batch (flattened leaves)."""
    remote_outputs: tuple[RemoteValue, ...] = ()
    """Forward steps that keep their output: where it stays."""


class StepFuture:
    """A step on its way: ``result()`` waits for it and returns the mean microbatch loss."""

    def __init__(
        self,
        job: Job,
        call: StepCall,
        mode: str = "train",
        reads: tuple[RemoteValue, ...] = (),
        index: int | None = None,
    ):
        self._job = job
        self._call = call
        """A Step call, or the Steps call this step went in (at ``index``)."""
        self._index = index
        self._mode = mode
        self._result: StepResult | None = None
        self._reads = reads
        """The remote values the step reads: held while it is on its way, so that a handle the
        caller did not keep (``job.step_async(other.forward(x, keep=True), y)``) is not freed first."""
        for value in reads:
            value._read_by(call)

    def done(self) -> bool:
        return self._call.done()

    def details(self, timeout_s: float | None = None) -> StepResult:
        """The whole result: loss, microbatch losses, step number, per-rank measured memory."""
        if self._result is None:
            try:
                client = self._job._client
                reply = self._call.reply(timeout_s, client.reconnect_timeout_s, self._job._send_lost_calls)
                if self._index is not None:
                    reply = reply.replies[self._index]
            except JobFailed:
                self._job.state = "failed"
                raise
            memory = {int(r): m for r, m in json.loads(reply.memory_json or "{}").items()}
            outputs = tuple(tensor_from_pb(t, "output") for t in reply.outputs)
            kept = tuple(RemoteValue(self._job._client, ref) for ref in reply.kept_outputs)
            self._result = StepResult(
                reply.loss, tuple(reply.microbatch_losses), reply.step, memory, self._mode, outputs, kept
            )
            last = self._job.last
            if last is None or self._result.step > last.step:
                self._job.last = self._result
        return self._result

    def result(self, timeout_s: float | None = None) -> float:
        return self.details(timeout_s).loss


class Job:
    """A pipeline loaded on the cluster: its plan, and its weights and optimizer state on the workers."""

    def __init__(self, client: Client, job_id: str, plan: Plan, next_step: int = 1):
        self._client = client
        self.id = job_id
        self.plan = plan
        self.last: StepResult | None = None
        """The latest step whose result has been read, of any mode (``last.mode``: "train",
        "evaluate" or "forward"), with its loss, per-rank memory and data-plane bytes."""
        self._next_seq = next_step
        self.max_in_flight = self.MAX_IN_FLIGHT
        """Calls sent and not yet finished (a step, or the steps of one ``steps_async``); one more
        waits for the oldest."""
        self._pending: list[StepFuture] = []
        self._lock = threading.Lock()
        self.direct_batch_bytes: int | None = self.DIRECT_BATCH_BYTES
        """A step whose tensors hold this many bytes or more posts them straight to the workers
        that read them, not through the controller (atoll.client.direct); None: never."""
        self._poster = BatchPoster(client, job_id)
        self.state = "ready"
        """As this client last saw it: "ready", "failed" (a step raised JobFailed) or "closed"."""

    @property
    def name(self) -> str:
        """The job's name (``pipeline(..., name=...)``, else its model's class)."""
        return self.plan.report.get("name", "")

    def __repr__(self) -> str:
        return f"<atoll.Job {self.id} {self.name!r} {self.state}, {self.plan.report.get('ranks', '?')} ranks>"

    def step_async(self, input, target) -> StepFuture:
        """Send one training step and return at once. Steps run in the order they are sent;
        sending the next before this one finishes hides the control plane's latency (the
        controller dispatches it while the workers still run this one)."""
        return self._send("train", input, target)

    def steps_async(self, batches) -> list[StepFuture]:
        """Send several training steps, ``[(input, target), ...]``, in one call and return at once:
        one future per step, in order. They run exactly as that many ``step_async`` calls would
        (the same numbers, order and results), but the controller and every worker get them as
        one message, so small steps pay the control plane's per-call cost once per call rather
        than once per step (as Keras' ``steps_per_execution``). The controller checks every step
        before any runs: a bad one refuses the call and runs nothing. Tensors or remote values
        (``put_batch``'s); a failure fails the job, and so every step of the call."""
        sent = [(_batch(input, "input"), _batch(target, "target")) for input, target in batches]
        if not sent:
            raise InvalidInput("steps_async takes at least one (input, target) pair")
        self._wait_for_window()
        with self._lock:
            first, self._next_seq = self._next_seq, self._next_seq + len(sent)
            # each step built in place, its tensors too: a StepRequest made first would be copied
            # whole into the call's message, its batch's bytes too (a 4-step call of 1 MiB steps:
            # 7.8 ms of the client's CPU, against 12.2 with both copies)
            request = pb.StepsRequest()
            for seq, (input, target) in enumerate(sent, first):
                request.steps.add(job_id=self.id, seq=seq, mode="train", **self._batch(seq, input, target))
            call = StepCall(self._client._endpoint, "Steps", request, self._client.step_timeout_s * len(sent))
            steps = [StepFuture(self, call, "train", (*i[1], *t[1]), index=n) for n, (i, t) in enumerate(sent)]
            self._pending += steps
        return steps

    def put_batch(self, input, target) -> tuple:
        """Place a batch on the workers that read it, once: its input on the first stage's worker,
        its target on the last stage's (the least loaded workers for a job that names no readers,
        an auto_resume one). Step on the handles as often as needed, ``step(*batch)`` or
        ``steps_async([batch, ...])``: no step carries their bytes again, as with a dataset held in
        each rank's memory. Returns (input, target) as ``RemoteValue``s, a tuple of them for a
        tuple of tensors; free them (``free()``) when done. In a data-parallel job the first
        replica's readers hold the whole batch and the other replicas' pull it, each keeping its
        own rows."""
        holders = self._poster.holders()

        def placed(value, holder: str, what: str):
            handles = tuple(self._client.put(t, worker=holder) for t in as_leaves(value, what))
            return handles if isinstance(value, (tuple, list)) else handles[0]

        return placed(input, holders[0], "input"), placed(target, holders[1], "target")

    def evaluate(self, input, target) -> float:
        """The mean microbatch loss of a full batch with the weights after every step sent so
        far: the plan's forward actions alone, no backward, no update."""
        return self._send("evaluate", input, target, wait=True).result()

    def forward(self, input, keep: bool = False):
        """The model's output for a full batch (the last stage's output, microbatches concatenated
        along dim 0): a tensor, or a tuple of them for a model with several outputs. With
        ``keep``, the output stays on the worker that made it: ``RemoteValue``s instead."""
        result = self._send("forward", input, None, keep, wait=True).details()
        outputs = result.remote_outputs if keep else result.outputs
        return outputs[0] if len(outputs) == 1 else outputs

    def _send(self, mode: str, input, target, keep: bool = False, wait: bool = False) -> StepFuture:
        """Send one step; ``wait``: its caller waits for it at once, so the call is made in this
        thread and returns answered (atoll.client.calls.StepCall), holding the job's lock until
        then: a step sent from another thread meanwhile goes out after it, as it would run."""
        input = _batch(input, "input")
        target = ([], (), []) if target is None else _batch(target, "target")
        self._wait_for_window()
        with self._lock:
            seq = self._next_seq
            request = pb.StepRequest(
                job_id=self.id, keep_outputs=keep, seq=seq, mode=mode, **self._batch(seq, input, target)
            )
            self._next_seq += 1
            call = StepCall(self._client._endpoint, "Step", request, self._client.step_timeout_s, wait)
            step = StepFuture(self, call, mode, (*input[1], *target[1]))
            self._pending.append(step)  # _wait_for_window just dropped the finished ones
        return step

    def _batch(self, seq: int, input, target) -> dict:
        """Step ``seq``'s StepRequest fields for its input and target (each as module ``_batch``
        gives it): the remote values it names and where they sit among the tensors, and its
        tensors, or their specs once the tensors are posted to the workers that read them
        (``direct_batch_bytes``; never beside remote values, whose holders are named at dispatch).
        Call holding the lock, so posts and steps go out in step order."""
        (inputs, input_values, input_at), (targets, target_values, target_at) = input, target
        fields = {
            "input_refs": [v.ref for v in input_values],
            "target_refs": [v.ref for v in target_values],
            "input_ref_at": input_at,
            "target_ref_at": target_at,
            "inputs": inputs,
            "targets": targets,
        }
        nbytes = sum(len(t["data"]) for t in (*inputs, *targets))
        postable = not (input_values or target_values)
        if postable and self.direct_batch_bytes is not None and nbytes >= self.direct_batch_bytes:
            inputs, targets = [pb.TensorData(**t) for t in inputs], [pb.TensorData(**t) for t in targets]
            if self._poster.post(seq, inputs, targets):
                fields.update(inputs=specs_only(inputs), targets=specs_only(targets), direct=True)
        return fields

    DIRECT_BATCH_BYTES = 2 << 20
    """Default ``direct_batch_bytes``: below it a step's one message through the controller costs
    less than a post to each reading worker besides (bench/direct_batches.py measures both)."""

    # Default steps in flight per job: enough to hide the control plane's latency; bounded so
    # waiting steps never tie up every request thread of the controller.
    MAX_IN_FLIGHT = 4

    def _wait_for_window(self) -> None:
        while True:
            with self._lock:
                self._pending = [f for f in self._pending if not f.done()]
                calls = len({id(f._call) for f in self._pending})  # the steps of one steps_async: one call
                oldest = self._pending[0] if calls >= self.max_in_flight else None
            if oldest is None:
                return
            try:
                oldest.details()
            except Exception:  # its owner sees the error from its own future
                pass

    def step(self, input, target) -> float:
        """One training step on a full batch; returns the mean microbatch loss."""
        return self._send("train", input, target, wait=True).result()

    def _send_lost_calls(self) -> None:
        """Send again, in step order, every call of this job that did not reach the controller
        (atoll.client.calls)."""
        with self._lock:
            calls = list({id(f._call): f._call for f in self._pending}.values())
        for call in calls:
            call.send_again()

    def _wait_for_sent_steps(self) -> None:
        """Wait until every step this client has sent has ended (its own future reports errors)."""
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            try:
                future.details()
            except Exception:  # its owner sees the error from its own future; a refused step changed nothing
                pass

    def timeline(
        self, steps: list[int] | None = None, *, last: int = 1, path: str | os.PathLike | None = None
    ) -> Trace:
        """The timelines of steps sent so far (by their numbers, 1 = the job's first call; by
        default the last ``last``): each worker's actions as measured beside the compiler's
        prediction, with the bubble fractions. Workers keep their last 64 steps. With ``path``,
        also writes the Chrome trace JSON there (open it in https://ui.perfetto.dev)."""
        self._wait_for_sent_steps()
        request = pb.TimelineRequest(job_id=self.id, steps=list(steps or []), last=last)
        reply = self._client._call("GetTimeline", request)
        trace = Trace(json.loads(reply.trace_json), json.loads(reply.summary_json))
        if path is not None:
            trace.save(path)
        return trace

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights after every step sent so far, with the keys of the model's ``state_dict()``."""
        self._wait_for_sent_steps()
        reply = self._client._call("GetState", pb.JobRef(job_id=self.id, session=self._client.session), timeout_s=300.0)
        return {t.name: tensor_from_pb(t.tensor, t.name) for t in reply.tensors}

    def save(self, path: str | os.PathLike) -> dict:
        """Checkpoint the job after every step sent so far: each worker writes its own weights and
        optimizer state to ``path`` (storage the workers and the controller share), in safetensors
        files under a JSON manifest, never through the client or the controller. The new version
        replaces the previous one only once complete. Restore with ``pipeline(..., resume_from=path)``,
        in any layout. Returns ``{"path", "version", "step"}``."""
        self._wait_for_sent_steps()
        request = pb.SaveRequest(job_id=self.id, path=os.fspath(path), session=self._client.session)
        reply = self._client._call("Save", request, timeout_s=600.0)
        return {"path": reply.path, "version": reply.version, "step": reply.step}

    def close(self) -> None:
        """Free the job on every worker (idempotent)."""
        self._client._call("CloseJob", pb.JobRef(job_id=self.id))
        self._poster.close()
        self.state = "closed"

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _batch(value, what: str) -> tuple[list[dict], tuple[RemoteValue, ...], list[int]]:
    """A step's input or target: the tensors to send (as TensorData's fields: the step's request
    builds them in place, atoll.core.wire.tensor_fields), the remote values to name, and the
    positions of the remote values among them (empty when every one is remote;
    atoll.core.wire.interleave)."""
    leaves = list(value) if isinstance(value, (tuple, list)) else [value]
    remote = tuple(v for v in leaves if isinstance(v, RemoteValue))
    for v in remote:
        if v.freed:
            raise InvalidInput(f"{what}: {v} was freed")
    if not remote:
        return [tensor_fields(t) for t in as_leaves(value, what)], (), []
    plain = [v for v in leaves if not isinstance(v, RemoteValue)]
    if plain:
        as_leaves(plain, what)  # tensors, or a clear error
    at = [] if not plain else [i for i, v in enumerate(leaves) if isinstance(v, RemoteValue)]
    return [tensor_fields(t) for t in plain], remote, at
