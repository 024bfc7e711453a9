"""The client API: connect to a controller, submit a pipeline or a program, attach to a job."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import torch
from torch import nn

from atoll._rpc import atoll_pb2 as pb
from atoll.client import calibrate, lora
from atoll.client.connection import Connection, open_connection
from atoll.client.export import export_pipeline
from atoll.client.job import Job
from atoll.client.plan import Plan
from atoll.client.program import Program
from atoll.client.remote import RemoteValue
from atoll.core.config import JobConfig
from atoll.core.wire import spec_to_pb, tensor_to_pb
from atoll.errors import InvalidInput, NotFound
from atoll.net.tls import Tls

# The JobConfig fields a Program decides itself (compile refuses them as settings). Every other
# field is a keyword argument of Client.pipeline of the same name, which it hands to compile as is:
# the settings are spelled once, in pipeline's signature, and become a JobConfig once, in compile.
_PROGRAM_DECIDES = ("stages", "split_at", "islands")
# and those the calibration of schedule="auto" sets (atoll.client.calibrate)
_CALIBRATION_SETS = ("layout_steps",)
_PIPELINE_SETTINGS = tuple(
    f.name for f in dataclasses.fields(JobConfig) if f.name not in _PROGRAM_DECIDES + _CALIBRATION_SETS
)


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
        reshard_after_forward: bool = False,
        tensor_parallel: int = 1,
        tensor_parallel_plan: dict[str, str] | None = None,
        tensor_parallel_strict: bool = False,
        sequence_parallel: bool = False,
        resume_from: str | os.PathLike = "",
        detached: bool = False,
        auto_resume: bool = False,
        checkpoint_every: int = 100,
        checkpoint_path: str | os.PathLike = "",
        schedule_costs: dict[str, float] | None = None,
        auto_microbatches: tuple[int, ...] = (),
        auto_virtual_stages: tuple[int, ...] = (),
        base_name: str = "",
        base: str = "",
        precision: str = "fp32",
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
        shapes later given to ``Job.step``. ``schedule`` is "gpipe", "1f1b", "zb_h1" (1F1B
        with each backward split into its input and weight halves, the weight halves filling the
        bubbles: zero bubble, Qi et al.), "zb_h2" (ZB-H1 with about twice its stashed
        microbatches, so that steps sent together leave no bubble), "interleaved_1f1b" (with
        ``virtual_stages`` model chunks per worker), "zbv" (``virtual_stages=2``, in a V, with
        split backwards), "dualpipev" (``virtual_stages=2``, ZBV's V in DeepSeek's DualPipe
        order, at least as many microbatches as stages) or "auto": a short
        calibration (a few steps of throw-away copies on the example batch) measures each stage's
        forward and backward on the workers, the compiler simulates every schedule that runs
        ``virtual_stages`` chunks per worker at those costs and keeps the fastest; the plan's
        ``schedule_choice`` lists each candidate's predicted step time and why the choice won.
        ``schedule_costs`` (seconds by stage and kind, "0F", "0B", "0I", "0W", ...) skips the
        calibration and simulates at those costs. ``auto_microbatches`` and ``auto_virtual_stages``
        (with "auto") are other microbatch counts and chunks per worker the job may run with: every
        candidate is calibrated in each such layout and in the job's own, and the job runs in the
        layout whose fastest copy stepped fastest (the plan's ``schedule_choice["layout_steps"]``,
        by "MxV"): fewer microbatches pay fewer small kernels' fixed costs and a longer fill and
        drain of the pipeline. Other chunks per worker need the stages cut by cost (no ``split_points``).

        ``device`` is the kind of worker the job runs on: "cpu", or "cuda" (workers started with
        ``--device cuda:N``; the model is exported on CPU and moved there by the workers).
        ``transport`` is "auto" (each edge's transport follows from placement: socket between CPU
        workers, cuda_ipc between workers on one GPU, nccl between GPUs, gloo between a CPU and a
        GPU worker) or one of "socket", "gloo", "cuda_ipc", "nccl" forced for every edge.
        ``islands`` names, per rank, the island its worker must be on ("" for any). ``exclusive``
        asks for workers no other job uses and keeps them (by default jobs share workers, ordered
        by the gang schedule). When the cluster cannot meet
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
        microbatches of the batch. ``zero`` shards model state over the replicas as the ZeRO
        stages do: 1, each replica keeps and steps only its 1/D of the optimizer state, the
        updated parameters then all-gathered; 2, the gradients are reduce-scattered too, each
        replica keeping its 1/D; 3, the parameters too, gathered at the start of every step
        (the plan's GATHER action) and freed once the gradients are reduced (RELEASE). With
        ``reshard_after_forward=True`` (zero=3, as FSDP2's setting of that name) each stage is a
        unit gathered before each of its forwards and backwards and freed after it, the next
        compute's unit gathered while the current one runs: a rank then holds one or two units'
        whole parameters at a time (cut a pure data-parallel job into units with
        ``virtual_stages`` and ``schedule="interleaved_1f1b"``). The plan's
        ``predicted_memory[rank]["at_step"]`` is the model state at the optimizer step.

        ``tensor_parallel=T`` runs every stage sharded over an island of T workers (Megatron-LM):
        the compiler finds the column-/row-parallel linear pairs (MLPs, attention by heads), splits
        embeddings by vocabulary and pairs a vocabulary-sharded LM head with a vocabulary-parallel
        cross-entropy; the rest stays whole on every rank, and the plan lists what was cut how.
        ``tensor_parallel_plan`` maps module names to "colwise", "rowwise", "vocab_embedding" (what
        the compiler must find) or "replicate" (keep whole). A linear layer left whole otherwise
        is named in the plan with why, and the submission warns with the share of the stage's
        parameters and FLOPs that stays undivided; ``tensor_parallel_strict=True`` refuses the job
        instead. The layout takes
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

        ``precision="bf16"`` trains in mixed precision as ``torch.autocast`` does (the policy of
        FSDP2's MixedPrecisionPolicy with float32 reductions): each stage computes under autocast
        to bfloat16 while parameters, gradients, their reductions and the optimizer state stay
        float32, and activations and their gradients cross between stages in bfloat16 (half the
        bytes; the plan's edges say so). "fp16" is refused: it needs loss scaling.

        ``base_name`` and ``base`` are set by ``load_base`` and ``lora``.
        """
        arguments = dict(locals())  # before any other local: exactly the keyword arguments above
        program = Program()
        x, y = program.input("input", example_input), program.input("target", example_target)
        out = program.stage(model, x, island=islands or "", stages=stages, split_points=split_points)
        program.loss(loss_fn, out, y)
        settings = {name: arguments[name] for name in _PIPELINE_SETTINGS}
        # what JobConfig holds as plain data: a dict, and paths as strings
        settings.update(
            tensor_parallel_plan=dict(tensor_parallel_plan or {}),
            resume_from=os.fspath(resume_from),
            checkpoint_path=os.fspath(checkpoint_path),
            schedule_costs=dict(schedule_costs or {}),
        )
        return self.compile(program, **settings)

    def load_base(self, model: nn.Module, *, name: str, detached: bool = True, **settings) -> Job:
        """Load ``model`` once as a resident base called ``name``: its parameters frozen, held on
        its workers until the returned job is closed (``detached`` by default: it outlives this
        client). ``settings`` are ``pipeline``'s (``example_input``, ``example_target``,
        ``loss_fn``, ``stages``, ``microbatches``, ...): the layout every job attached to it
        (``lora``) runs in. The base job itself can ``evaluate`` and ``forward``."""
        trained = [p for p in model.parameters() if p.requires_grad]
        for p in trained:  # exported frozen; the caller's model is left as it was
            p.requires_grad_(False)
        try:
            return self.pipeline(model, name=name, base_name=name, detached=detached, **settings)
        finally:
            for p in trained:
                p.requires_grad_(True)

    def lora(
        self,
        model: nn.Module,
        *,
        base: str,
        rank: int,
        targets: list[str],
        alpha: float | None = None,
        optimizer: str = "adamw",
        init: dict[str, torch.Tensor] | str | os.PathLike | None = None,
        **settings,
    ) -> lora.AdapterJob:
        """A job training LoRA adapters (Hu et al.: W0 x + (alpha / rank) B A x) of rank ``rank`` on
        the ``targets`` linear layers (names or their last parts, as PEFT's ``target_modules``) of
        the resident base ``base`` (``load_base``). ``model`` is the base model as this client has
        it: only its structure is used; the workers compute with the base's own tensors, held once
        for every job attached. The job runs in the base's layout, on its workers, cut where it is
        cut; its steps run beside the other attached jobs' steps, filling each other's pipeline
        bubbles. Its state (``state_dict``, ``save``) is its adapters and their optimizer state.
        ``alpha`` defaults to ``rank``. ``init``: starting adapter tensors (a dict, or a directory
        saved by ``AdapterJob.save_adapter`` or PEFT), else PEFT's initialization. ``settings`` are
        ``pipeline``'s (``example_input``, ``example_target``, ``loss_fn``, ``microbatches``, ...),
        less the layout, which is the base's."""
        config = lora.LoraConfig(rank=rank, alpha=float(rank if alpha is None else alpha), targets=tuple(targets))
        if isinstance(init, (str, os.PathLike)):
            init, saved = lora.load_adapter(init)
            if saved != config:
                raise InvalidInput(f"the adapter at the given path is {saved}, not {config}")
        layout = self._base_layout(base)
        taken = sorted(layout.keys() & settings.keys())
        if taken:
            raise InvalidInput(f"a job attached to a base runs in the base's layout; do not give {', '.join(taken)}")
        adapted = lora.with_adapters(model, config, init)
        if layout["tensor_parallel"] > 1:  # each A cut only where its input comes sharded (its B follows)
            plan = dict(settings.pop("tensor_parallel_plan", None) or {})
            settings["tensor_parallel_plan"] = {**lora.adapter_tp_plan(adapted), **plan}
        job = self.pipeline(adapted, base=base, optimizer=optimizer, **layout, **settings)
        return lora.AdapterJob(self, job.id, job.plan, config)

    def _base_layout(self, base: str) -> dict[str, int]:
        """The resident base's layout, as ``pipeline``'s settings."""
        held = [j for j in self.status().jobs if j.base_name == base and j.state == "ready"]
        if not held:
            raise NotFound(f"no resident base named {base!r} is loaded (see Client.load_base)")
        report = self.job(held[0].job_id).plan.report
        layout = report["layout"]
        return {
            "stages": layout["pipeline"],
            "virtual_stages": len(report["stages"]) // layout["pipeline"],
            "data_parallel": layout["data"],
            "tensor_parallel": layout["tensor"],
        }

    def put(self, tensor: torch.Tensor, island: str = "", worker: str = "") -> RemoteValue:
        """Place ``tensor`` on a worker (``worker``, a worker id, else the least loaded of
        ``island``) once; pass the handle to steps in place of the tensor, as many times as needed
        (``Job.put_batch`` places a batch on the workers that read it)."""
        request = pb.PutValueRequest(tensor=tensor_to_pb(tensor), island=island, worker_id=worker)
        reply = self._call("PutValue", request)
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
        for name in ("auto_microbatches", "auto_virtual_stages"):
            if name in settings:
                settings[name] = _values(name, settings[name])
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
        layouts = config.layouts()  # checked before anything is exported
        example_input, example_target = program.example_batch()
        for degree in ("data_parallel", "tensor_parallel"):  # the wire reads 0 as "not set"
            value = getattr(config, degree)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInput(f"{degree} must be a positive integer, got {value!r}")
        replicas = config.data_parallel
        exports = {}

        def exported_at(count: int):
            """The program exported at the shape of one of ``count`` microbatches of one replica."""
            if count not in exports:
                try:
                    # a job attached to a resident base sends the base's parameters as shapes: the workers hold them
                    frozen_values = not config.base
                    exports[count] = export_pipeline(
                        model, example_input, example_target, program.loss_fn, count * replicas, frozen_values
                    )
                except InvalidInput:
                    if len(program.stage_names) > 1:
                        program.check_stages(count * replicas)  # names the stage that fails, and what it reads
                    raise
            return exports[count]

        exported_at(microbatches)
        self._keep_alive()

        def submit(config: JobConfig) -> Job:
            exported = exported_at(config.microbatches)
            request = pb.PipelineProgram(
                model_program=exported.model,
                loss_program=exported.loss,
                input=spec_to_pb(exported.input),
                target=spec_to_pb(exported.target),
                aliases=exported.aliases,
                config=config.to_pb(),
                session=self.session,
            )
            reply = self._call("SubmitPipeline", request, timeout_s=600.0)
            return Job(self, reply.job_id, Plan(json.loads(reply.plan_json)))

        if config.schedule == "auto" and not config.schedule_costs:
            for count, _ in layouts:  # a count the batch does not divide into is refused before any copy loads
                exported_at(count)
            config = self._calibrated(config, submit, (example_input, example_target))
        job = submit(config)
        for warning in job.plan.report.get("warnings", ()):  # e.g. layers tensor parallelism left whole
            warnings.warn(warning, stacklevel=3)
        return job

    def _calibrated(self, config: JobConfig, submit, batch: tuple) -> JobConfig:
        """schedule="auto": ``config`` with each stage's action costs measured on calibration copies
        of the job, in the layout chosen among its ``layouts`` (atoll.client.calibrate)."""
        return calibrate.calibrated(config, calibrate.run_copies(submit, calibrate.calibration_configs(config), batch))

    def parameter_server(self, model: nn.Module, *, example_input, example_target, loss_fn, **settings):
        """A parameter-server job (atoll.client.parameter_server): ``servers`` workers hold the
        model as key ranges, ``workers`` tasks each pull, compute on their own batches and push,
        under ``consistency`` "sequential", "bounded" (``max_delay``) or "eventual"; ``optimizer``
        "sgd" or "adamw" with ``lr`` and ``weight_decay`` runs on the servers; ``replication``
        servers hold each key range. Embedding tables move only the rows a batch touches."""
        from atoll.client import parameter_server

        return parameter_server.submit(self, model, example_input, example_target, loss_fn, **settings)

    def job(self, job_id: str) -> Job:
        """Attach to a job that is already loaded (raises NotFound for an unknown id)."""
        reply = self._call("GetPlan", pb.JobRef(job_id=job_id))
        return Job(self, job_id, Plan(json.loads(reply.plan_json)), next_step=reply.next_step)


def _values(name: str, value) -> tuple:
    """``auto_microbatches`` or ``auto_virtual_stages`` as JobConfig holds them: a tuple (a list
    given, or one number)."""
    if isinstance(value, int):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        raise InvalidInput(f"{name} must be a list of numbers, got {value!r}") from None


def connect(
    address: str | None = None,
    token: str | None = None,
    *,
    token_file: str | None = None,
    timeout_s: float = 120.0,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    reconnect_timeout_s: float = 60.0,
) -> Client:
    """A client of the controller at ``address`` (``HOST:PORT``; default: $ATOLL_CONTROLLER); the
    token defaults to $ATOLL_TOKEN or the token file ($ATOLL_TOKEN_FILE, else ~/.atoll/token).
    ``tls_ca`` (a PEM file) connects over TLS to a controller started with ``--tls-*``;
    ``tls_cert``/``tls_key`` present a client certificate. Both are checked at once: a wrong token
    raises ``Unauthenticated`` here, a controller that does not answer ``ControllerUnavailable``.
    A step whose controller cannot be reached later is sent again for up to ``reconnect_timeout_s``
    (a controller restarted on its state directory takes its jobs back), then raises
    ``ControllerUnavailable``."""
    tls = Tls.from_files(tls_ca, tls_cert, tls_key)
    return open_connection(Client, address, token, token_file, timeout_s, tls, reconnect_timeout_s)
