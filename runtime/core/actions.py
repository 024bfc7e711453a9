"""The instruction set workers interpret: each action kind declared once, and one typed, printable
action per entry of a schedule.

A kind is an ``ActionSpec``: what the simulator, the memory plan, the communication count, the
timelines and lowering need to know of it (its category, the direction it belongs to, whether it
runs once per step, its default cost, its group, its memory effect). They read the declaration,
never a list of kinds, so adding a kind is one ``declare`` here and one handler registered in the
executor (runtime/worker/executor/handlers.py); on the wire an instruction names its kind by its
code, so the proto needs no edit either.

Actions print like torch.distributed.pipelining's ``_Action`` (``2F5``, ``0B3``, ``1SEND_F0``,
``0REDUCE_GRAD``), so a schedule can be compared with torch's and written in tests as golden text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from atoll._rpc import atoll_pb2 as pb

Category = Literal["compute", "send", "recv", "collective", "step", "local"]
"""How a kind takes part in a step:
- compute: runs a stage on one microbatch (its inputs come from a receive or a local hand-off);
- send / recv: posts a transfer of its stage's edges in its direction (never blocks at once);
- collective: meets its ``group`` (the ranks holding a tied parameter, or the data-parallel replicas);
- step: the optimizer step (waits until every send of the rank has been taken);
- local: works on this rank's own state and waits on nothing but the action before it."""


@dataclass(frozen=True, eq=False, slots=True)
class ActionSpec:
    """One action kind. Compared by identity: each kind is declared once."""

    name: str
    """Its name in code (``FORWARD``)."""
    code: str
    """How an action of this kind prints and travels (``F`` in ``2F5``)."""
    category: Category
    direction: Literal["forward", "backward"] | None = None
    """For compute, send and recv kinds: the pass they belong to, which pairs a compute with the
    receive it takes and the send that carries its result. A compute kind without one (the
    weight-gradient half of a split backward) takes and sends nothing."""
    requires: str | None = None
    """For compute kinds: the code of the kind that must have run on the same stage and
    microbatch first (a backward needs its forward; a weight gradient its input gradient)."""
    grads: Literal["input", "weight", "both"] | None = None
    """For backward compute kinds: the gradients it computes (a stage's backward is complete once
    its kinds have computed both)."""
    per_step: bool = False
    """Runs once per step, so it carries no microbatch."""
    forward_only: bool = False
    """Runs in evaluation and forward steps too."""
    cost: float = 0.0
    """The simulator's default duration, in forwards of one stage and microbatch."""
    group: Literal["tied", "replicas"] | None = None
    """For collectives: whom it meets."""
    memory: Literal["stash", "hold", "release", "observe", "gather", "reduce", "free"] | None = None
    """Its effect on the memory plan: a forward stashes activations, a backward releases them,
    an input-gradient backward holds what its weight-gradient half will read (the stash stays),
    a step is a point where memory is observed; under ZeRO-3 a gather makes the rank's whole
    parameters (or a stage's) resident (observed), under ZeRO the replicas' reduction leaves each
    replica its gradient shard (ZeRO-2/3), and a free drops gathered parameters (ZeRO-3)."""

    @property
    def value(self) -> str:
        return self.code

    def runs_in(self, mode: str) -> bool:
        return mode == "train" or self.forward_only

    def __repr__(self) -> str:
        return f"Kind.{self.name}"

    def __reduce__(self):  # a copy or an unpickled action must keep the one declared kind
        return kind_of, (self.code,)


_BY_CODE: dict[str, ActionSpec] = {}


def declare(name: str, code: str, category: Category, **fields) -> ActionSpec:
    """Declare an action kind; its code must be new and must not make printed actions ambiguous."""
    if not re.fullmatch(r"[A-Z][A-Z_]*", code):
        raise ValueError(f"action code {code!r}: capitals and underscores only")
    if code in _BY_CODE or any(k.name == name for k in _BY_CODE.values()):
        raise ValueError(f"action kind {name} ({code}) is declared already")
    spec = ActionSpec(name, code, category, **fields)
    _BY_CODE[code] = spec
    return spec


def kinds() -> list[ActionSpec]:
    """Every declared kind, in declaration order."""
    return list(_BY_CODE.values())


def kind_of(code: str) -> ActionSpec:
    try:
        return _BY_CODE[code]
    except KeyError:
        raise ValueError(f"unknown action kind {code!r} (known: {', '.join(_BY_CODE)})") from None


def paired(kind: ActionSpec, category: Category) -> ActionSpec:
    """The kind of ``category`` in ``kind``'s direction: the receive a compute takes, the send that
    carries its result, the compute a send or receive serves."""
    for k in _BY_CODE.values():
        if k.category == category and k.direction == kind.direction and not k.per_step:
            return k
    raise ValueError(f"no {category} kind declared for the {kind.direction} direction")


class Kind:
    """The kinds the compiler lowers every schedule to."""

    FORWARD = declare("FORWARD", "F", "compute", direction="forward", forward_only=True, cost=1.0, memory="stash")
    BACKWARD = declare(
        "BACKWARD", "B", "compute", direction="backward", requires="F", grads="both", cost=2.0, memory="release"
    )
    """About twice the forward: it computes input and weight gradients."""
    BACKWARD_INPUT = declare(
        "BACKWARD_INPUT", "I", "compute", direction="backward", requires="F", grads="input", cost=1.0, memory="hold"
    )
    """The input-gradient half of a split backward (zero-bubble schedules, Qi et al. 2024): the
    gradients the previous stage waits for, sent at once; what the weight gradients need is kept."""
    BACKWARD_WEIGHT = declare(
        "BACKWARD_WEIGHT", "W", "compute", requires="I", grads="weight", cost=1.0, memory="release"
    )
    """The weight-gradient half: needs nothing from any peer, so a schedule places it in a bubble."""
    SEND_F = declare("SEND_F", "SEND_F", "send", direction="forward", forward_only=True)
    RECV_F = declare("RECV_F", "RECV_F", "recv", direction="forward", forward_only=True)
    SEND_B = declare("SEND_B", "SEND_B", "send", direction="backward")
    RECV_B = declare("RECV_B", "RECV_B", "recv", direction="backward")
    REDUCE_GRAD = declare("REDUCE_GRAD", "REDUCE_GRAD", "collective", per_step=True, group="tied")
    """Sum the gradients of tied parameters across the stages holding them (before STEP)."""
    ALL_REDUCE_GRAD = declare(
        "ALL_REDUCE_GRAD", "ALL_REDUCE_GRAD", "collective", per_step=True, group="replicas", memory="reduce"
    )
    """Average every gradient of the rank across the data-parallel replicas (before STEP); under
    ZeRO-2/3 a reduce-scatter, each replica keeping its shard's average."""
    GATHER_PARAMS = declare(
        "GATHER_PARAMS", "GATHER", "collective", per_step=True, forward_only=True, group="replicas", memory="gather"
    )
    """ZeRO-3: all-gather the rank's parameter shards from the replicas, first in every step (with
    ``reshard_after_forward``: the stage's, before each compute that needs them and is not
    preceded by the stage's own). It starts the gather; the compute that needs it waits."""
    RELEASE_PARAMS = declare("RELEASE_PARAMS", "RELEASE", "local", per_step=True, forward_only=True, memory="free")
    """ZeRO-3: free the gathered parameters (the rank's, after the reduction; with
    ``reshard_after_forward``, the stage's after each compute not followed by the stage's own)."""
    STEP = declare("STEP", "STEP", "step", per_step=True, memory="observe")


_ACTION_RE = re.compile(r"^(\d+)([A-Z_]+?)(\d*)$")


@dataclass(frozen=True, slots=True)
class Action:
    """``stage`` is the pipeline stage (model chunk) index; ``microbatch`` is None for per-step kinds."""

    stage: int
    kind: ActionSpec
    microbatch: int | None = None

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind.code}{mb}"

    __repr__ = __str__

    @property
    def is_compute(self) -> bool:
        return self.kind.category == "compute"

    @staticmethod
    def parse(text: str) -> Action:
        match = _ACTION_RE.match(text.strip())
        if match is None or match.group(2) not in _BY_CODE:
            raise ValueError(f"not an action: {text!r} (expected e.g. '2F5', '1SEND_F0', '0STEP')")
        stage, code, mb = match.groups()
        return Action._checked(int(stage), _BY_CODE[code], int(mb) if mb else None, f"not an action: {text!r}")

    @staticmethod
    def _checked(stage: int, kind: ActionSpec, microbatch: int | None, what: str) -> Action:
        if kind.per_step != (microbatch is None):
            per_step = ", ".join(k.code for k in _BY_CODE.values() if k.per_step)
            raise ValueError(f"{what} ({per_step} take no microbatch, others need one)")
        if stage < 0 or (microbatch or 0) < 0:
            raise ValueError(f"{what} (negative stage or microbatch)")
        return Action(stage, kind, microbatch)

    def to_pb(self) -> pb.Instruction:
        return pb.Instruction(stage=self.stage, kind=self.kind.code, microbatch=self.microbatch)

    @staticmethod
    def from_pb(msg: pb.Instruction) -> Action:
        """Raises ValueError for an instruction no worker could run."""
        kind = kind_of(msg.kind)
        microbatch = msg.microbatch if msg.HasField("microbatch") else None
        what = f"malformed instruction: stage {msg.stage}, kind {kind.code}, microbatch {microbatch}"
        return Action._checked(msg.stage, kind, microbatch, what)


def F(stage: int, mb: int) -> Action:
    return Action(stage, Kind.FORWARD, mb)


def B(stage: int, mb: int) -> Action:
    return Action(stage, Kind.BACKWARD, mb)


def I(stage: int, mb: int) -> Action:  # noqa: E743 (torch's name for the kind)
    return Action(stage, Kind.BACKWARD_INPUT, mb)


def W(stage: int, mb: int) -> Action:
    return Action(stage, Kind.BACKWARD_WEIGHT, mb)
