"""One typed job configuration, crossing every boundary as one structure (docs/architecture.md,
"Configuration"): ``Client.pipeline``'s keyword arguments -> ``pb.JobConfig`` -> the compiler's
request -> each worker's plan. Adding a setting means one field here and one in the proto's
``JobConfig``; conversion goes field by field, so nothing is spelled twice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from google.protobuf import json_format

from atoll._rpc import atoll_pb2 as pb
from atoll.core.names import AUTO_CANDIDATES, SPLIT_BACKWARD_SCHEDULES
from atoll.errors import InvalidInput


@dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    stages: int
    """Pipeline ranks, one worker each."""
    microbatches: int
    """Microbatches per step."""
    schedule: str = "gpipe"
    """One of atoll.core.names.SCHEDULES, or "auto" (the fastest the simulator predicts, see
    ``schedule_costs``)."""
    virtual_stages: int = 1
    """Model chunks per rank (interleaved schedules)."""
    optimizer: str = "sgd"
    """"sgd", "adam" or "adamw" (atoll.core.optim.OPTIMIZERS)."""
    optimizer_args: dict = field(default_factory=dict)
    """Plain keyword arguments of the optimizer (numbers, bools, lists of numbers)."""
    split_at: tuple[str, ...] = ()
    """Names of the modules where stages 1, 2, ... start; empty: balanced by cost."""
    rematerialize: bool = False
    """Recompute each stage's forward during backward instead of stashing its activations."""
    data_plane_timeout_s: float = 60.0
    """Deadline of every data-plane wait (receive, send completion, group join)."""
    device: str = "cpu"
    """Device kind of the workers the job runs on: "cpu" or "cuda"."""
    transport: str = "auto"
    """"auto": each edge's transport follows from placement; or "socket", "gloo", "cuda_ipc", "nccl"."""
    name: str = ""
    """A label shown by status."""
    islands: tuple[str, ...] = ()
    """Per rank, the island its worker must be on ("" or absent: any island)."""
    exclusive: bool = False
    """Run on workers no other job uses, and keep them to itself (else: shared, in gang order)."""
    admission_timeout_s: float = 0.0
    """How long a request the cluster cannot meet now waits in the admission queue (0: fail at once)."""
    weight: float = 1.0
    """Share of shared workers' time against other busy jobs (controller/cluster/fairness.py)."""
    dispatch: str = "parallel"
    """"parallel": a step goes to all its workers at once, directly up to 16 workers and relayed
    through a tree of the job's workers above (controller/cluster/dispatch.py); "direct" or "relay" force one of the
    two; "sequential": each rank only once the previous one has started its step. All but
    "parallel" exist to measure what it saves."""
    data_parallel: int = 1
    """Replicas of the whole pipeline, each on its own ``stages`` workers, each given 1/data_parallel
    of every batch; gradients are averaged across them before the optimizer step."""
    zero: int = 0
    """ZeRO stage (Rajbhandari et al., 2020) over the data-parallel replicas (runtime/worker/executor/zero.py):
    1: each replica keeps and steps 1/data_parallel of the optimizer state, and the updated
    parameters are all-gathered; 2: the gradients are reduce-scattered too, each replica keeping
    only its shard; 3: the parameters are sharded as well, gathered for a step and freed after
    its backward; 0: every replica keeps and steps everything."""
    tensor_parallel: int = 1
    """Workers per pipeline rank: each stage runs sharded over an island of this many workers
    (Megatron-LM tensor parallelism, controller/compiler/parallel/tensor/)."""
    tensor_parallel_plan: dict = field(default_factory=dict)
    """Module name -> "colwise", "rowwise", "vocab_embedding" (what the compiler must find it to be)
    or "replicate" (keep it whole); modules not named are sharded as the compiler finds them."""
    sequence_parallel: bool = False
    """With tensor parallelism: the token-wise code between its layers (residual adds, LayerNorm,
    dropout) runs on 1/tensor_parallel of the sequence (controller/compiler/parallel/sequence.py)."""
    resume_from: str = ""
    """A checkpoint directory (``Job.save``): the job starts from its weights and optimizer state,
    whatever layout saved them."""
    detached: bool = False
    """Keep the job when the client that submitted it goes away (by default it is closed once the
    client's lease runs out, controller/cluster/leases.py)."""
    auto_resume: bool = False
    """After a worker failure, restore the job from its last checkpoint onto live workers and replay
    the steps since (controller/resume.py); such a job saves to ``checkpoint_path`` every
    ``checkpoint_every`` training steps and runs its steps one at a time."""
    checkpoint_every: int = 100
    """Training steps between the checkpoints of an ``auto_resume`` job."""
    checkpoint_path: str = ""
    """Where an ``auto_resume`` job keeps its checkpoint (storage the workers and the controller share)."""
    tensor_parallel_strict: bool = False
    """Refuse the job when a linear layer would stay whole on every rank of an island (one the
    plan does not name "replicate"); by default it stays whole and the plan warns."""
    schedule_costs: dict = field(default_factory=dict)
    """For ``schedule="auto"``: seconds each action takes, by stage and kind ("0F", "0B", "0I",
    "0W", ...), as measured on the workers (``Client.pipeline`` calibrates them); the compiler
    simulates every candidate schedule at these costs. Empty: the stages' FLOP counts stand in."""
    base_name: str = ""
    """Load this job as a resident base model of that name (``Client.load_base``): its parameters
    are frozen and stay on its workers until it is closed, and adapter jobs attach to them."""
    base: str = ""
    """The resident base this job attaches to (``Client.lora``): its frozen parameters are the
    base's own tensors on the base's workers (held once, whatever the number of jobs attached),
    its stages are cut where the base's are, and its steps run beside the other attached jobs'
    rather than after them, so one job's microbatches fill another's pipeline bubbles."""
    precision: str = "fp32"
    """"fp32": every stage computes in the model's own dtypes. "bf16": mixed precision as
    torch.autocast does it, with the parameters, their gradients, the gradient reductions and the
    optimizer state kept in float32: each stage's forward (and the loss) runs under
    ``torch.autocast(dtype=torch.bfloat16)``, and every floating tensor crossing between stages
    travels in bfloat16 (half the bytes), upcast to the receiving stage's dtype on arrival."""
    reshard_after_forward: bool = False
    """With ``zero=3``, as FSDP2's setting of that name: each stage (model chunk) of a rank is a unit
    of its own, gathered from the replicas' shards before each of its forwards and backwards and
    freed after it, the next compute's unit gathered while the current one runs; its gradients are
    reduce-scattered after its last backward. A rank then holds its shards, one or two units'
    whole parameters and one unit's gradients at a time, instead of all of its parameters for the
    whole step (runtime/worker/executor/zero.py). Units follow the stages: ``virtual_stages`` cuts
    a pure data-parallel job (``stages=1``) into that many."""
    auto_microbatches: tuple[int, ...] = ()
    """For ``schedule="auto"``: other microbatch counts the job may run at (``layouts``)."""
    auto_virtual_stages: tuple[int, ...] = ()
    """For ``schedule="auto"``: other numbers of model chunks per worker the job may run with
    (``layouts``; the stages are then cut by cost: no ``split_at``)."""
    layout_steps: dict = field(default_factory=dict)
    """Set by ``Client.pipeline``'s calibration where ``auto_microbatches`` or
    ``auto_virtual_stages`` were given: the step in seconds of each layout (``layout_name``, "MxV": M microbatches,
    V chunks per worker) as its fastest calibration copy measured it; the shortest chose
    ``microbatches`` and ``virtual_stages``. The plan's ``schedule_choice`` lists them."""

    def auto_candidates(self) -> tuple[str, ...]:
        """The schedules ``schedule="auto"`` chooses among for this job: those that run
        ``virtual_stages`` chunks per worker, less the split-backward ones where the job's settings
        refuse them (``split_backward_refused``), DualPipeV where it has fewer microbatches than
        stages and interleaved 1F1B where its rounds do not divide the microbatches."""
        names = AUTO_CANDIDATES.get(self.virtual_stages)
        if names is None:
            known = ", ".join(map(str, AUTO_CANDIDATES))
            raise InvalidInput(
                f'schedule "auto" runs {known} chunk(s) per worker, not virtual_stages={self.virtual_stages}'
            )
        if self.split_backward_refused():
            names = tuple(n for n in names if n not in SPLIT_BACKWARD_SCHEDULES)
        if self.microbatches < 2 * self.stages:  # DualPipeV needs as many microbatches as stages
            names = tuple(n for n in names if n != "dualpipev")
        if self.microbatches % max(1, self.microbatches // self.stages):  # as Topology.rounds
            names = tuple(n for n in names if n != "interleaved_1f1b")
        return names

    def layouts(self) -> tuple[tuple[int, int], ...]:
        """The (microbatches, virtual_stages) pairs the job may run with: its own first, then each
        of ``microbatches`` and ``auto_microbatches`` with each of ``virtual_stages`` and
        ``auto_virtual_stages``. Raises InvalidInput where a count is not a positive integer, a
        number of chunks is not one "auto" runs, or they are given to a schedule other than "auto"
        or (other chunks) with the stages' cuts named or to a job attached to a base."""
        given = {"auto_microbatches": self.auto_microbatches, "auto_virtual_stages": self.auto_virtual_stages}
        for name, values in given.items():
            if values and self.schedule != "auto":
                raise InvalidInput(f'{name} are for schedule "auto" to choose among, not for {self.schedule!r}')
            for value in values:
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise InvalidInput(f"{name} must be positive integers, got {value!r}")
        chunks = (self.virtual_stages, *sorted(set(self.auto_virtual_stages) - {self.virtual_stages}))
        unknown = [v for v in chunks[1:] if v not in AUTO_CANDIDATES]
        if unknown:
            known = ", ".join(map(str, AUTO_CANDIDATES))
            raise InvalidInput(f'schedule "auto" runs {known} chunk(s) per worker, not auto_virtual_stages {unknown}')
        if len(chunks) > 1 and self.base:
            raise InvalidInput(
                "a job attached to a base runs in the base's chunks per worker: give no auto_virtual_stages"
            )
        if len(chunks) > 1 and self.split_at:
            raise InvalidInput(
                "auto_virtual_stages change the number of stages: give no split points (the stages are cut by cost)"
            )
        counts = (self.microbatches, *sorted(set(self.auto_microbatches) - {self.microbatches}))
        return tuple((m, v) for m in counts for v in chunks)

    def split_backward_refused(self) -> str:
        """Why this job's settings cannot split a backward (a zero-bubble schedule), or ""."""
        if self.rematerialize:
            return "with rematerialize it is not built yet"
        if self.tensor_parallel > 1:
            return "a tensor-parallel stage's backward collectives would split with it (not built yet)"
        return ""

    def to_pb(self) -> pb.JobConfig:
        return _fill(pb.JobConfig(), self)

    @staticmethod
    def from_pb(msg: pb.JobConfig) -> JobConfig:
        """A field left at the message's zero value takes its default here."""
        values = {}
        for f in dataclasses.fields(JobConfig):
            value = _read(msg, f)
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required and not value:
                raise InvalidInput(f"job configuration is incomplete: {f.name} must be set to a positive value")
            if value:
                values[f.name] = value
        return JobConfig(**values)


def layout_name(microbatches: int, chunks: int) -> str:
    """A layout as ``JobConfig.layout_steps`` names it: "8x2", 8 microbatches, 2 chunks per worker."""
    return f"{microbatches}x{chunks}"


def layout_of(name: str) -> tuple[int, int]:
    """(microbatches, chunks per worker) of a ``layout_name``."""
    microbatches, chunks = name.split("x")
    return int(microbatches), int(chunks)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerSettings:
    """What a worker's executor needs of its job's settings, and nothing more: its layout (the
    degrees of parallelism, its coordinates, its groups) comes in the plan's mesh (atoll.core.mesh),
    so a worker never reads the user's configuration."""

    microbatches: int
    optimizer: str
    optimizer_args: dict
    rematerialize: bool
    zero: int
    """ZeRO stage (JobConfig.zero): this replica steps its shard of the flat parameters."""
    data_plane_timeout_s: float
    weight: float = 1.0
    """The job's share of the worker against the other jobs whose steps it interleaves with
    this one's (runtime/worker/interleave.py), as JobConfig.weight."""
    precision: str = "fp32"
    """JobConfig.precision: "bf16" runs the forward under autocast."""
    reshard_after_forward: bool = False
    """JobConfig.reshard_after_forward: ZeRO-3 gathers and frees each stage's parameters per compute."""

    @staticmethod
    def of(cfg: JobConfig) -> WorkerSettings:
        return WorkerSettings(
            microbatches=cfg.microbatches,
            optimizer=cfg.optimizer,
            optimizer_args=dict(cfg.optimizer_args),
            rematerialize=cfg.rematerialize,
            zero=cfg.zero,
            data_plane_timeout_s=cfg.data_plane_timeout_s,
            weight=cfg.weight,
            precision=cfg.precision,
            reshard_after_forward=cfg.reshard_after_forward,
        )

    def to_pb(self) -> pb.WorkerSettings:
        return _fill(pb.WorkerSettings(), self)

    @staticmethod
    def from_pb(msg: pb.WorkerSettings) -> WorkerSettings:
        if msg.microbatches < 1 or not msg.data_plane_timeout_s > 0:
            raise InvalidInput(
                f"plan's settings: microbatches {msg.microbatches} and data_plane_timeout_s "
                f"{msg.data_plane_timeout_s} must be positive"
            )
        settings = WorkerSettings(**{f.name: _read(msg, f) for f in dataclasses.fields(WorkerSettings)})
        return settings if settings.weight > 0 else dataclasses.replace(settings, weight=1.0)  # 0: not set


def _fill(msg, settings):
    """``msg`` with every field of the dataclass ``settings`` set from it, by name."""
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if isinstance(value, dict):
            json_format.ParseDict(value, getattr(msg, f.name))
        elif isinstance(value, tuple):
            getattr(msg, f.name).extend(value)
        else:
            setattr(msg, f.name, value)
    return msg


def _read(msg, f: dataclasses.Field):
    """The message's field of the dataclass field ``f``'s name, as the dataclass holds it."""
    value = getattr(msg, f.name)
    if f.type == "dict":
        return json_format.MessageToDict(value)
    if f.type.startswith("tuple"):
        return tuple(value)
    return value
