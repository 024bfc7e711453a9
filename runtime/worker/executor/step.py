"""What one step holds while it runs on a worker: pending receives, stashed activations, input
gradients waiting for their readers, sends in flight, losses, and what it measured."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from atoll.core.actions import Action
from atoll.core.memory import PeakMeter
from atoll.core.spans import StepSpans
from atoll.worker.transports.gloo import Handle


class ActionFailed(RuntimeError):
    """An action of the list failed; the message names rank, position and action."""


@dataclass(slots=True)
class Stash:
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]  # flat stage outputs, or [loss] on the last stage
    nbytes: int


@dataclass(slots=True)
class InputGrads:
    by_position: dict[int, torch.Tensor]
    readers: int
    """Producers still to take them: one per local edge in, one SEND_B for all remote edges."""


@dataclass(slots=True)
class StepState:
    mode: str
    input_mbs: list[list[torch.Tensor]] | None
    target_mbs: list[list[torch.Tensor]] | None
    pending_recvs: dict[Action, tuple[list[torch.Tensor], list[Handle]]] = field(default_factory=dict)
    stash: dict[tuple[int, int], Stash] = field(default_factory=dict)
    input_grads: dict[tuple[int, int], InputGrads] = field(default_factory=dict)
    weight_halves: dict[tuple[int, int], tuple] = field(default_factory=dict)
    """Per (stage, microbatch) between its I and its W: what W needs and the bytes it holds."""
    sends: list[Handle] = field(default_factory=list)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    """Read once at the end of the step: reading each at once would make the host wait for the GPU."""
    outputs: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Forward mode: the last stage's output per microbatch."""
    activation_bytes: int = 0
    meter: PeakMeter = field(default_factory=PeakMeter)
    sent_bytes: int = 0
    received_bytes: int = 0
    """Tensor bytes this rank moved over its transports in the step (local hand-offs excluded)."""
    all_reduced_bytes: int = 0
    """Gradient bytes this rank put into the data-parallel all-reduce (what gloo moves for them
    depends on its algorithm)."""
    island_bytes: int = 0
    """Bytes this rank put into its tensor-parallel island's collectives."""
    waiting_s: float = 0.0
    """Time spent blocked on the data plane: the measured bubble plus transfer time."""
    spans: StepSpans = field(default_factory=lambda: StepSpans(0))

    def take_input_grads(self, s: int, m: int, reader) -> dict[int, torch.Tensor]:
        """The input gradients of ``s``B``m``, for one of their readers (freed after the last)."""
        held = self.input_grads.get((s, m))
        if held is None:
            raise RuntimeError(f"{reader} takes the input gradients of {s}B{m}, which has not run here")
        held.readers -= 1
        if held.readers == 0:
            del self.input_grads[(s, m)]
        return held.by_position
