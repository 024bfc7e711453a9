"""The instruction set workers interpret: one typed, printable action per entry of a schedule.

Actions print like torch.distributed.pipelining's ``_Action`` (``2F5``, ``0B3``, ``1SEND_F0``),
so a schedule can be compared with torch's, written in tests as golden text, and sent over the
wire as plain strings.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Kind(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    STEP = "STEP"


COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD})

# What a step runs of the plan's action list, by mode: training runs all of it; evaluation and
# inference run the forward actions alone (the same order and buffers, no backward, no update).
FORWARD_ONLY = frozenset({Kind.RECV_F, Kind.FORWARD, Kind.SEND_F})
STEP_MODES: dict[str, frozenset[Kind] | None] = {"train": None, "evaluate": FORWARD_ONLY, "forward": FORWARD_ONLY}

# Longest alternatives first so "SEND_F" is not read as "S" + garbage.
_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|STEP|F|B)(\d*)$")


@dataclass(frozen=True, slots=True)
class Action:
    """``stage`` is the pipeline stage (model chunk) index; ``microbatch`` is None for STEP."""

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
        if (kind is Kind.STEP) != (mb == ""):
            raise ValueError(f"not an action: {text!r} (STEP takes no microbatch, others need one)")
        return Action(int(stage), kind, int(mb) if mb else None)


def F(stage: int, mb: int) -> Action:
    return Action(stage, Kind.FORWARD, mb)


def B(stage: int, mb: int) -> Action:
    return Action(stage, Kind.BACKWARD, mb)
