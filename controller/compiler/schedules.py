"""Pipeline schedules as pure functions: topology -> per-rank lists of compute actions.

Communication is not here; the lowering pass adds it. Orders follow the papers and match what
torch.distributed.pipelining executes for the same sizes (tests compare them):

- GPipe (Huang et al. 2019): all forwards, then all backwards.
- 1F1B (PipeDream-flush, Narayanan et al. 2021): rank r runs min(M, S - r) forwards, then
  alternates one backward and one forward, then drains the backwards. It holds at most
  min(S - r, M) microbatches of activations instead of GPipe's M.
- Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): each rank holds V model chunks;
  forwards walk the chunks in rounds of microbatches, backwards walk them in reverse.
- ZB-H1 (zero bubble, Qi et al. 2024): 1F1B with each backward split into its input-gradient
  half I, which the previous rank waits for, and its weight-gradient half W, which nobody waits
  for: rank r runs P - r forwards, then F and I alternately, and starts its W's r steps late, so
  they fill the bubbles 1F1B leaves at the end of a step; memory stays 1F1B's. The order is
  torch.distributed.pipelining's ScheduleInterleavedZeroBubble at one stage per rank.
- ZB-H2 (Qi et al. 2024, section 3.1): ZB-H1 given more memory. Rank r runs 2(P - r) - 1
  forwards before its first input gradient (ZB-H1: P - r) and starts its W's 2r microbatches
  late, so the step's layout turns from ZB-H1's trapezoid into a parallelogram: rank r starts r
  forwards after rank 0 and ends about as much after it, and at equal F, I and W costs a step
  that follows another has no bubble (tests/test_schedules.py simulates it). Each rank's
  optimizer step waits only for its own weight gradients, so the parallelograms of successive
  steps fit into each other. The last rank starts its W's one microbatch later still: a first
  stage's inputs need no gradient, so its whole backward is W, and the first rank's tail (its
  last W, optimizer step and next forward) outlasts the paper's by an input half, which one more
  W on the last rank covers (at costs measured on the 2-rank MLP job of bench/pipeline.py:
  simulated 1.7% shorter steps back to back, measured 1.026x steps/s, median of 6 alternated
  rounds). It stashes up to 2(P - r) - 1 microbatches, about twice ZB-H1's. torch ships no
  ZB-H2; the order is atoll's rule for the paper's handcrafted shape.
- ZBV (Qi et al. 2024, section 6): two chunks per rank placed in a V (rank r holds stage r and
  stage 2P - 1 - r, so the first and last stages share rank 0 and the turn of the V is a local
  hand-off on rank P - 1), with split backwards; each rank warms up on its down chunk, then runs
  F, I, W of its two chunks in turn. At equal F, I and W costs it has no bubble. The order is
  torch's ScheduleZBVZeroBubble.
- DualPipeV (DeepSeek-V3's DualPipe, folded into a V: the "cut-in-half" DualPipe of the DualPipe
  repository): ZBV's placement, with the steady phase pairing one chunk's forward with the other
  chunk's full backward (torch's OVERLAP_F_B; atoll runs the pair one after the other, as a
  device without a second stream would), zero-bubble split backwards at the edges, and at least
  as many microbatches as stages. The order is torch's ScheduleDualPipeV.
"""

from __future__ import annotations

from collections.abc import Callable

from atoll.controller.compiler.topology import Topology
from atoll.core.actions import Action, B, F, I, W

Schedule = dict[int, list[Action]]


def gpipe(topo: Topology) -> Schedule:
    M = topo.microbatches
    return {r: [F(r, m) for m in range(M)] + [B(r, m) for m in range(M)] for r in range(topo.ranks)}


def one_f_one_b(topo: Topology) -> Schedule:
    S, M = topo.ranks, topo.microbatches
    order: Schedule = {}
    for r in range(S):
        warmup = min(M, S - r)
        ops = [F(r, m) for m in range(warmup)]
        next_f = warmup
        for m in range(M):
            ops.append(B(r, m))
            if next_f < M:
                ops.append(F(r, next_f))
                next_f += 1
        order[r] = ops
    return order


def interleaved_1f1b(topo: Topology) -> Schedule:
    return {r: _interleaved_rank(topo, r) for r in range(topo.ranks)}


def _interleaved_rank(topo: Topology, r: int) -> list[Action]:
    P, V, M = topo.ranks, topo.virtual_stages, topo.microbatches
    per_round = topo.microbatches_per_round
    total = V * M
    # the last rank warms up one round per extra chunk; each hop upstream adds two more
    warmup = min((V - 1) * per_round + 2 * (P - 1 - r), total)
    next_mb = {"F": [0] * V, "B": [0] * V}
    ops: list[Action] = []

    def emit(kind: str, chunk: int) -> None:
        make = F if kind == "F" else B
        ops.append(make(chunk * P + r, next_mb[kind][chunk]))
        next_mb[kind][chunk] += 1

    forward_chunk = lambda k: (k // per_round) % V  # noqa: E731
    backward_chunk = lambda k: V - 1 - (k // per_round) % V  # noqa: E731
    for k in range(warmup):
        emit("F", forward_chunk(k))
    for k in range(total - warmup):
        emit("F", forward_chunk(warmup + k))
        emit("B", backward_chunk(k))
    for k in range(total - warmup, total):
        emit("B", backward_chunk(k))
    return ops


def zb_h1(topo: Topology) -> Schedule:
    S, M = topo.ranks, topo.microbatches
    return {r: _split_1f1b(r, M, warmup=min(S - 1 - r, M), weight_lag=r) for r in range(S)}


def zb_h2(topo: Topology) -> Schedule:
    S, M = topo.ranks, topo.microbatches
    return {r: _split_1f1b(r, M, warmup=min(2 * (S - 1 - r), M), weight_lag=2 * r + (r == S - 1)) for r in range(S)}


def _split_1f1b(r: int, M: int, warmup: int, weight_lag: int) -> list[Action]:
    """Rank (and stage) ``r``: ``warmup`` forwards, then per microbatch a forward while any is
    left and an input gradient, and from the ``weight_lag``-th on a weight gradient; the weight
    gradients still owed at the end."""
    ops = [F(r, m) for m in range(warmup)]
    next_f, next_w = warmup, 0
    for m in range(M):
        if next_f < M:
            ops.append(F(r, next_f))
            next_f += 1
        ops.append(I(r, m))
        if m >= weight_lag:
            ops.append(W(r, next_w))
            next_w += 1
    return ops + [W(r, m) for m in range(next_w, M)]


def zbv(topo: Topology) -> Schedule:
    return {r: _zbv_rank(topo, r) for r in range(topo.ranks)}


def _zbv_rank(topo: Topology, r: int) -> list[Action]:
    P, M = topo.ranks, topo.microbatches
    # the steady phase is written for at least 2P - 1 microbatches; the ones past M are dropped
    n = max(2 * P - 1, M)
    down, up = topo.stages_of(r)
    ops: list[Action] = []
    count = {(down, "F"): 0, (up, "F"): 0, (down, "I"): 0, (up, "I"): 0, (down, "W"): 0, (up, "W"): 0}

    def emit(stage: int, kind: str) -> None:
        ops.append({"F": F, "I": I, "W": W}[kind](stage, count[(stage, kind)]))
        count[(stage, kind)] += 1

    def backward(stage: int) -> None:
        emit(stage, "I")
        emit(stage, "W")

    for _ in range(2 * (P - r) - 1):  # down the V as far as the microbatches reach
        emit(down, "F")
    for _ in range(r):
        emit(up, "F")
        emit(down, "F")
    for _ in range(P - r):  # the first microbatches come back up: their backwards start
        emit(up, "F")
        backward(up)
    while count[(up, "F")] < count[(down, "F")] or count[(down, "F")] < n:
        if count[(down, "F")] < n:
            emit(down, "F")
        backward(down)
        emit(up, "F")
        backward(up)
    for _ in range(r):  # cool-down: input halves first, the weight halves fill what is left
        emit(down, "I")
        emit(up, "I")
    for _ in range(P - r):
        emit(down, "I")
        emit(down, "W")
    while count[(up, "W")] < count[(up, "I")]:
        emit(up, "W")
    while count[(down, "W")] < count[(down, "I")]:
        emit(down, "W")
    return [a for a in ops if a.microbatch < M]


def dualpipev(topo: Topology) -> Schedule:
    return {r: _dualpipev_rank(topo, r) for r in range(topo.ranks)}


def _dualpipev_rank(topo: Topology, r: int) -> list[Action]:
    P, M = topo.ranks, topo.microbatches
    down, up = topo.stages_of(r)
    ops: list[Action] = []
    count: dict[tuple[int, str], int] = {}
    pending_w: list[tuple[int, int]] = []  # (stage, microbatch) of input halves whose weight half waits

    def emit(stage: int, kind: str) -> None:
        key = (stage, "I" if kind == "B" else kind)  # a full backward counts as both halves
        mb = count.get(key, 0)
        ops.append({"F": F, "B": B, "I": I}[kind](stage, mb))
        count[key] = mb + 1
        if kind == "I":
            pending_w.append((stage, mb))

    def weight() -> None:
        if pending_w:
            ops.append(W(*pending_w.pop(0)))

    for _ in range(2 * (P - r - 1)):  # down the V
        emit(down, "F")
    for _ in range(r + 1):
        emit(down, "F")
        emit(up, "F")
    for _ in range(P - r - 1):  # the first microbatches come back up, zero-bubble
        emit(up, "I")
        weight()
        emit(up, "F")
    for _ in range(M - 2 * P + r + 1):  # the steady phase: one chunk's F beside the other's B
        emit(down, "F")
        emit(up, "B")
        emit(up, "F")
        emit(down, "B")
    for _ in range(P - r - 1):
        emit(up, "B")
        emit(up, "F")
        emit(down, "B")
    split = False
    for i in range(r + 1):  # the second half of the backwards split again, to fill the drain
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        emit(up, "I" if split else "B")
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        emit(down, "I" if split else "B")
    for _ in range(P - r - 1):
        weight()
        emit(down, "I" if split else "B")
    for _ in range(r + 1):
        weight()
    return ops


BUILDERS: dict[str, Callable[[Topology], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zb_h1,
    "zb_h2": zb_h2,
    "zbv": zbv,
    "dualpipev": dualpipev,
}


"""One per name of atoll.core.config.SCHEDULES, the one list of them (tests/test_schedules.py holds the two alike)."""


def build_schedule(topo: Topology) -> Schedule:
    return BUILDERS[topo.schedule](topo)
