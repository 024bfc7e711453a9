"""The client API: connect to a controller, submit a pipeline, train it step by step."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass

import torch
from torch import nn

from atoll._rpc import atoll_pb2 as pb
from atoll.client.connection import Connection, open_connection
from atoll.client.export import as_leaves, export_pipeline
from atoll.client.plan import Plan
from atoll.client.program import Program
from atoll.client.remote import RemoteValue
from atoll.client.trace import Trace
from atoll.core.config import JobConfig
from atoll.core.wire import spec_to_pb, tensor_from_pb, tensor_to_pb
from atoll.errors import InvalidInput, JobFailed
from atoll.net.tls import Tls


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

    def __init__(self, job: Job, future, mode: str = "train", reads: tuple[RemoteValue, ...] = ()):
        self._job = job
        self._future = future
        self._mode = mode
        self._result: StepResult | None = None
        self._reads = reads
        """The remote values the step reads: held while it is on its way, so that a handle the
        caller did not keep (``job.step_async(other.forward(x, keep=True), y)``) is not freed first."""
        for value in reads:
            value._read_by(future)

    def done(self) -> bool:
        return self._future.done()

    def details(self, timeout_s: float | None = None) -> StepResult:
        """The whole result: loss, microbatch losses, step number, per-rank measured memory."""
        if self._result is None:
            try:
                reply = self._job._client._endpoint.resolve(self._future, "Step", timeout_s)
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
        """Steps sent and not yet finished; one more ``step_async`` waits for the oldest."""
        self._pending: list[StepFuture] = []
        self._lock = threading.Lock()
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

    def evaluate(self, input, target) -> float:
        """The mean microbatch loss of a full batch with the weights after every step sent so
        far: the plan's forward actions alone, no backward, no update."""
        return self._send("evaluate", input, target).result()

    def forward(self, input, keep: bool = False):
        """The model's output for a full batch (the last stage's output, microbatches concatenated
        along dim 0): a tensor, or a tuple of them for a model with several outputs. With
        ``keep``, the output stays on the worker that made it: ``RemoteValue``s instead."""
        result = self._send("forward", input, None, keep).details()
        outputs = result.remote_outputs if keep else result.outputs
        return outputs[0] if len(outputs) == 1 else outputs

    def _send(self, mode: str, input, target, keep: bool = False) -> StepFuture:
        inputs, input_values, input_at = _batch(input, "input")
        targets, target_values, target_at = ([], (), []) if target is None else _batch(target, "target")
        self._wait_for_window()
        with self._lock:
            request = pb.StepRequest(
                job_id=self.id,
                inputs=inputs,
                targets=targets,
                input_refs=[v.ref for v in input_values],
                target_refs=[v.ref for v in target_values],
                input_ref_at=input_at,
                target_ref_at=target_at,
                keep_outputs=keep,
                seq=self._next_seq,
                mode=mode,
            )
            self._next_seq += 1
            future = self._client._endpoint.future("Step", request, self._client.step_timeout_s)
            step = StepFuture(self, future, mode, (*input_values, *target_values))
            self._pending.append(step)  # _wait_for_window just dropped the finished ones
        return step

    # Default steps in flight per job: enough to hide the control plane's latency; bounded so
    # waiting steps never tie up every request thread of the controller.
    MAX_IN_FLIGHT = 4

    def _wait_for_window(self) -> None:
        while True:
            with self._lock:
                self._pending = [f for f in self._pending if not f.done()]
                oldest = self._pending[0] if len(self._pending) >= self.max_in_flight else None
            if oldest is None:
                return
            try:
                oldest.details()
            except Exception:  # its owner sees the error from its own future
                pass

    def step(self, input, target) -> float:
        """One training step on a full batch; returns the mean microbatch loss."""
        return self.step_async(input, target).result()

    def _wait_for_sent_steps(self) -> None:
        """Wait until every step this client has sent has ended (its own future reports errors)."""
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.details()

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
        reply = self._client._call("GetState", pb.JobRef(job_id=self.id), timeout_s=300.0)
        return {t.name: tensor_from_pb(t.tensor, t.name) for t in reply.tensors}

    def save(self, path: str | os.PathLike) -> dict:
        """Checkpoint the job after every step sent so far: each worker writes its own weights and
        optimizer state to ``path`` (storage the workers and the controller share), in safetensors
        files under a JSON manifest, never through the client or the controller. The new version
        replaces the previous one only once complete. Restore with ``pipeline(..., resume_from=path)``,
        in any layout. Returns ``{"path", "version", "step"}``."""
        self._wait_for_sent_steps()
        reply = self._client._call("Save", pb.SaveRequest(job_id=self.id, path=os.fspath(path)), timeout_s=600.0)
        return {"path": reply.path, "version": reply.version, "step": reply.step}

    def close(self) -> None:
        """Free the job on every worker (idempotent)."""
        self._client._call("CloseJob", pb.JobRef(job_id=self.id))
        self.state = "closed"

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Client(Connection):
    """A connection to the controller that submits programs (``atoll.connect`` makes one)."""

    def pipeline(
        self,
        model: nn.Module,
        *,
        example_input,
        example_target,
        loss_fn,
        stages: int,
        microbatches: int,
        schedule: str = "gpipe",
        virtual_stages: int = 1,
        optimizer: str = "sgd",
        optimizer_args: dict | None = None,
        split_points: list[str | int] | None = None,
        rematerialize: bool = False,
        data_plane_timeout_s: float = 60.0,
        device: str = "cpu",
        transport: str = "auto",
        name: str = "",
        islands: list[str] | None = None,
        exclusive: bool = False,
        admission_timeout_s: float = 0.0,
        weight: float = 1.0,
        dispatch: str = "parallel",
        data_parallel: int = 1,
        zero: int = 0,
        tensor_parallel: int = 1,
        tensor_parallel_plan: dict[str, str] | None = None,
        sequence_parallel: bool = False,
        resume_from: str | os.PathLike = "",
        detached: bool = False,
        auto_resume: bool = False,
        checkpoint_every: int = 100,
        checkpoint_path: str | os.PathLike = "",
    ) -> Job:
        """Compile ``model`` into a pipeline over ``stages`` workers and load it: the program of
        one stage, ``model``, over ``stages`` workers (see ``compile``).

        ``model`` is any ``nn.Module`` that ``torch.export`` can export at the microbatch shape.
        The controller cuts its graph into stages at submodule boundaries, balanced by cost, or
        where the modules named in ``split_points`` start (``["layers.2", "layers.4"]``; an
        integer ``i`` names the ``i``-th top-level child, so block indices of an
        ``nn.Sequential`` work). A value used by a later stage travels to it directly; a
        parameter used by several stages (tied weights) lives on each, its gradients summed.
        ``example_input``/``example_target`` are one full batch of the
        shapes later given to ``Job.step``. ``schedule`` is "gpipe", "1f1b" or
        "interleaved_1f1b" (with ``virtual_stages`` model chunks per worker).

        ``device`` is the kind of worker the job runs on: "cpu", or "cuda" (workers started with
        ``--device cuda:N``; the model is exported on CPU and moved there by the workers).
        ``transport`` is "auto" (each edge's transport follows from placement: cuda_ipc between
        workers on one GPU, nccl between GPUs, gloo otherwise) or one of "gloo", "cuda_ipc",
        "nccl" forced for every edge. ``islands`` names, per rank, the island its worker must be
        on ("" for any). ``exclusive`` asks for workers no other job uses and keeps them (by
        default jobs share workers, ordered by the gang schedule). When the cluster cannot meet
        the request now, it waits up to ``admission_timeout_s`` in the controller's admission
        queue (arrival order), then fails with ``NotEnoughWorkers``. Busy jobs sharing workers
        get their time in proportion to ``weight``. ``dispatch`` is "parallel" (every rank at once;
        above 16 workers relayed through a tree of the job's workers, so the controller makes one
        call per step however many workers there are), or, to measure what that saves, "direct",
        "relay" or "sequential" (each rank only once the previous one has started the step).

        ``data_parallel=D`` runs D replicas of the pipeline, each on its own ``stages`` workers
        (``stages * D`` in all): each replica takes 1/D of every batch (split into
        ``microbatches`` of its own) and the replicas average their gradients before every
        optimizer step, so training matches one process running all ``microbatches * D``
        microbatches of the batch. ``zero=1`` (ZeRO stage 1) has each replica keep and step only
        its 1/D of the optimizer state, the updated parameters then all-gathered.

        ``tensor_parallel=T`` runs every stage sharded over an island of T workers (Megatron-LM):
        the compiler finds the column-/row-parallel linear pairs (MLPs, attention by heads), splits
        embeddings by vocabulary and pairs a vocabulary-sharded LM head with a vocabulary-parallel
        cross-entropy; the rest stays whole on every rank, and the plan lists what was cut how.
        ``tensor_parallel_plan`` maps module names to "colwise", "rowwise", "vocab_embedding" (what
        the compiler must find) or "replicate" (keep whole). The layout takes
        ``stages * tensor_parallel * data_parallel`` workers; ``Job.state_dict()`` returns whole tensors.
        ``sequence_parallel=True`` (Korthikanti et al.) also runs the code between those layers
        (residual adds, LayerNorm, dropout) on 1/T of the sequence per worker.

        ``resume_from`` names a checkpoint (``Job.save``): the job starts from its weights and
        optimizer state, whatever placement, stage count or tensor-parallel degree saved it.
        ``auto_resume=True`` makes the job outlive its workers: it saves to ``checkpoint_path``
        when loaded and every ``checkpoint_every`` training steps, and when a worker dies it is
        restored from there onto live workers, the steps since replayed, before the next step goes
        on (controller/resume.py); ``step`` raises only if that fails. Its steps run one at a time.

        The job belongs to this client: once the client stops renewing its lease (it closed, or
        its process died), the controller closes the job after the lease timeout. ``detached=True``
        keeps it until ``Job.close`` (from any client: ``client.job(job_id)``).
        """
        program = Program()
        x, y = program.input("input", example_input), program.input("target", example_target)
        out = program.stage(model, x, island=islands or "", stages=stages, split_points=split_points)
        program.loss(loss_fn, out, y)
        return self.compile(
            program,
            microbatches=microbatches,
            schedule=schedule,
            virtual_stages=virtual_stages,
            optimizer=optimizer,
            optimizer_args=optimizer_args,
            rematerialize=rematerialize,
            data_plane_timeout_s=data_plane_timeout_s,
            device=device,
            transport=transport,
            name=name,
            exclusive=exclusive,
            admission_timeout_s=admission_timeout_s,
            weight=weight,
            dispatch=dispatch,
            data_parallel=data_parallel,
            zero=zero,
            tensor_parallel=tensor_parallel,
            tensor_parallel_plan=dict(tensor_parallel_plan or {}),
            sequence_parallel=sequence_parallel,
            resume_from=os.fspath(resume_from),
            detached=detached,
            auto_resume=auto_resume,
            checkpoint_every=checkpoint_every,
            checkpoint_path=os.fspath(checkpoint_path),
        )

    def put(self, tensor: torch.Tensor, island: str = "") -> RemoteValue:
        """Place ``tensor`` on a worker (of ``island``, least loaded) once; pass the handle to steps
        in place of the tensor, as many times as needed."""
        reply = self._call("PutValue", pb.PutValueRequest(tensor=tensor_to_pb(tensor), island=island))
        return RemoteValue(self, reply)

    def compile(self, program: Program, *, microbatches: int, optimizer_args: dict | None = None, **settings) -> Job:
        """Compile an MPMD ``Program`` and load it: each program stage on its workers (one, or a
        pipeline of several), each worker of its stage's island. ``settings`` are those of
        ``pipeline`` (schedule, optimizer, ...) less what the program decides (stages, split
        points, islands). The whole program is exported once, here; the controller splits it."""
        decided = {"stages", "split_points", "islands", "split_at"} & settings.keys()
        if decided:
            raise InvalidInput(f"a program decides {', '.join(sorted(decided))} itself")
        model = program.module()
        try:
            config = JobConfig(
                stages=program.ranks,
                microbatches=microbatches,
                optimizer_args=dict(optimizer_args or {}),
                split_at=tuple(program.split_at(settings.get("virtual_stages", 1))),
                islands=tuple(program.islands) if any(program.islands) else (),
                **{**settings, "name": settings.get("name") or program.default_name},
            )
        except TypeError as e:  # an unknown setting
            raise InvalidInput(f"unknown setting for compile/pipeline: {e}") from None
        example_input, example_target = program.example_batch()
        for degree in ("data_parallel", "tensor_parallel"):  # the wire reads 0 as "not set"
            value = getattr(config, degree)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInput(f"{degree} must be a positive integer, got {value!r}")
        replicas = config.data_parallel
        # exported at the shape of one microbatch of one replica
        try:
            exported = export_pipeline(model, example_input, example_target, program.loss_fn, microbatches * replicas)
        except InvalidInput:
            if len(program.stage_names) > 1:
                program.check_stages(microbatches * replicas)  # names the stage that fails, and what it reads
            raise
        request = pb.PipelineProgram(
            model_program=exported.model,
            loss_program=exported.loss,
            input=spec_to_pb(exported.input),
            target=spec_to_pb(exported.target),
            aliases=exported.aliases,
            config=config.to_pb(),
            session=self.session,
        )
        self._keep_alive()
        reply = self._call("SubmitPipeline", request, timeout_s=600.0)
        return Job(self, reply.job_id, Plan(json.loads(reply.plan_json)))

    def job(self, job_id: str) -> Job:
        """Attach to a job that is already loaded (raises NotFound for an unknown id)."""
        reply = self._call("GetPlan", pb.JobRef(job_id=job_id))
        return Job(self, job_id, Plan(json.loads(reply.plan_json)), next_step=reply.next_step)


def connect(
    address: str | None = None,
    token: str | None = None,
    *,
    token_file: str | None = None,
    timeout_s: float = 120.0,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> Client:
    """A client of the controller at ``address`` (``HOST:PORT``; default: $ATOLL_CONTROLLER); the
    token defaults to $ATOLL_TOKEN or the token file ($ATOLL_TOKEN_FILE, else ~/.atoll/token).
    ``tls_ca`` (a PEM file) connects over TLS to a controller started with ``--tls-*``;
    ``tls_cert``/``tls_key`` present a client certificate. Both are checked at once: a wrong token
    raises ``Unauthenticated`` here, a controller that does not answer ``WorkerUnavailable``."""
    return open_connection(Client, address, token, token_file, timeout_s, Tls.from_files(tls_ca, tls_cert, tls_key))


def _batch(value, what: str) -> tuple[list[pb.TensorData], tuple[RemoteValue, ...], list[int]]:
    """A step's input or target: the tensors to send, the remote values to name, and the positions
    of the remote values among them (empty when every one is remote; atoll.core.wire.interleave)."""
    leaves = list(value) if isinstance(value, (tuple, list)) else [value]
    remote = tuple(v for v in leaves if isinstance(v, RemoteValue))
    for v in remote:
        if v.freed:
            raise InvalidInput(f"{what}: {v} was freed")
    if not remote:
        return [tensor_to_pb(t) for t in as_leaves(value, what)], (), []
    plain = [v for v in leaves if not isinstance(v, RemoteValue)]
    if plain:
        as_leaves(plain, what)  # tensors, or a clear error
    at = [] if not plain else [i for i, v in enumerate(leaves) if isinstance(v, RemoteValue)]
    return [tensor_to_pb(t) for t in plain], remote, at
