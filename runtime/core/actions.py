"""The instruction set workers interpret: one typed, printable action per entry of a schedule.

Actions print like torch.distributed.pipelining's ``_Action`` (``2F5``, ``0B3``, ``1SEND_F0``,
``0REDUCE_GRAD``), so a schedule can be compared with torch's and written in tests as golden
text; on the wire they are typed messages (``Instruction``). Adding a kind means one entry here,
one in the proto's ``ActionKind``, and one handler in the executor's table.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from atoll._rpc import atoll_pb2 as pb


class Kind(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    STEP = "STEP"
    REDUCE_GRAD = "REDUCE_GRAD"
    """Sum the gradients of tied parameters across the stages holding them (before STEP)."""
    ALL_REDUCE_GRAD = "ALL_REDUCE_GRAD"
    """Average every gradient of the rank across the data-parallel replicas (before STEP)."""


COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD})
PER_STEP = frozenset({Kind.STEP, Kind.REDUCE_GRAD, Kind.ALL_REDUCE_GRAD})
"""Kinds that run once per step and so carry no microbatch."""

# What a step runs of the plan's action list, by mode: training runs all of it; evaluation and
# inference run the forward actions alone (the same order and buffers, no backward, no update).
FORWARD_ONLY = frozenset({Kind.RECV_F, Kind.FORWARD, Kind.SEND_F})
STEP_MODES: dict[str, frozenset[Kind] | None] = {"train": None, "evaluate": FORWARD_ONLY, "forward": FORWARD_ONLY}

# Longest alternatives first so "SEND_F" is not read as "S" + garbage.
_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|ALL_REDUCE_GRAD|REDUCE_GRAD|STEP|F|B)(\d*)$")


@dataclass(frozen=True, slots=True)
class Action:
    """``stage`` is the pipeline stage (model chunk) index; ``microbatch`` is None for PER_STEP kinds."""

    stage: int
    kind: Kind
    microbatch: int | None = None

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind.value}{mb}"

    __repr__ = __str__

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    @staticmethod
    def parse(text: str) -> Action:
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(f"not an action: {text!r} (expected e.g. '2F5', '1SEND_F0', '0STEP')")
        stage, kind, mb = match.groups()
        kind = Kind(kind)
        if (kind in PER_STEP) != (mb == ""):
            raise ValueError(
                f"not an action: {text!r} (STEP, REDUCE_GRAD and ALL_REDUCE_GRAD take no microbatch, others need one)"
            )
        return Action(int(stage), kind, int(mb) if mb else None)

    def to_pb(self) -> pb.Instruction:
        return pb.Instruction(stage=self.stage, kind=pb.ActionKind.Value(self.kind.name), microbatch=self.microbatch)

    @staticmethod
    def from_pb(msg: pb.Instruction) -> Action:
        """Raises ValueError for an instruction no worker could run."""
        try:
            kind = Kind[pb.ActionKind.Name(msg.kind)]
        except (KeyError, ValueError):
            raise ValueError(f"unknown instruction kind {msg.kind}") from None
        microbatch = msg.microbatch if msg.HasField("microbatch") else None
        if (kind in PER_STEP) != (microbatch is None) or msg.stage < 0 or (microbatch or 0) < 0:
            raise ValueError(f"malformed instruction: stage {msg.stage}, kind {kind.value}, microbatch {microbatch}")
        return Action(msg.stage, kind, microbatch)


def F(stage: int, mb: int) -> Action:
    return Action(stage, Kind.FORWARD, mb)


def B(stage: int, mb: int) -> Action:
    return Action(stage, Kind.BACKWARD, mb)
