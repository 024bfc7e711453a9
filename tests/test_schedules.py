"""Schedules, lowering and the deadlock simulator: pure functions, no processes."""

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from atoll.controller.compiler.lowering import lower
from atoll.controller.compiler.schedules import BUILDERS, build_schedule
from atoll.controller.compiler.simulate import ScheduleError, simulate, steady_step
from atoll.controller.compiler.topology import Topology
from atoll.core.actions import Action, Kind
from atoll.core.dataflow import BATCH, Dataflow, Edge, Routes, TiedParameter
from atoll.core.names import SCHEDULES
from atoll.core.wire import EdgeSpec, TensorSpec
from atoll.errors import InvalidInput
from tests.models import chain_routes

SIZES = [(2, 4), (4, 8), (4, 4)]  # (pipeline ranks, microbatches)


def topology(schedule: str, ranks: int, microbatches: int) -> Topology:
    virtual = 2 if schedule in ("interleaved_1f1b", "zbv", "dualpipev") else 1
    return Topology(ranks=ranks, virtual_stages=virtual, microbatches=microbatches, schedule=schedule)


def valid_topology(schedule: str, ranks: int, microbatches: int) -> Topology | None:
    """``topology``; None where DualPipeV, which needs as many microbatches as stages, refuses
    fewer, as it must."""
    if schedule == "dualpipev" and microbatches < 2 * ranks:
        with pytest.raises(InvalidInput, match="at least as many microbatches as stages"):
            topology(schedule, ranks, microbatches)
        return None
    return topology(schedule, ranks, microbatches)


# ----------------------------------------------------------------- torch's orders


class _RecordingStage:
    """Stands in for a torch PipelineStage: records compute calls, does no communication."""

    def __init__(self, index: int, num_stages: int):
        self.stage_index, self.num_stages, self.order = index, num_stages, []
        self.is_first, self.is_last = index == 0, index == num_stages - 1

    def forward_one_chunk(self, mb, *args, **kwargs):
        self.order.append(f"{self.stage_index}F{mb}")

    def backward_one_chunk(self, mb, **kwargs):
        self.order.append(f"{self.stage_index}B{mb}")

    def get_fwd_recv_ops(self, mb):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def perform_reduce_grad(self, *args):
        pass


def torch_single_stage_order(schedule: str, ranks: int, microbatches: int) -> dict[int, list[str]]:
    """What torch's ScheduleGPipe / Schedule1F1B execute, recorded from their own step loop.

    (Schedule1F1B._get_pipeline_order, torch's printable order, is not used: in torch 2.13 it
    starts the last rank at F1 and ends at F{microbatches}, which its runtime never does.)
    """
    cls = {"gpipe": torch_schedules.ScheduleGPipe, "1f1b": torch_schedules.Schedule1F1B}[schedule]
    order = {}
    for rank in range(ranks):
        sched = object.__new__(cls)
        sched._n_microbatches, sched._num_stages = microbatches, ranks
        sched._stage = _RecordingStage(rank, ranks)
        sched._check_inputs = lambda args, kwargs, *rest: ([()] * microbatches, [{}] * microbatches)
        sched._initialize_stage = sched._maybe_compute_loss = sched._maybe_get_loss = lambda *a, **k: None
        sched._update_losses = lambda *a, **k: None
        sched.scale_grads = True
        sched._step_microbatches([()] * microbatches, [{}] * microbatches)
        order[rank] = sched._stage.order
    return order


def torch_interleaved_order(ranks: int, virtual: int, microbatches: int) -> dict[int, list[str]]:
    sched = object.__new__(torch_schedules.ScheduleInterleaved1F1B)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = ranks, virtual, microbatches
    sched.number_of_rounds = max(1, microbatches // ranks)
    sched.microbatches_per_round = microbatches // sched.number_of_rounds
    return {r: [str(a) for a in sched._calculate_single_rank_operations(r) if a is not None] for r in range(ranks)}


def torch_zbv_order(ranks: int, microbatches: int) -> dict[int, list[str]]:
    """ZBV: torch's ScheduleZBVZeroBubble, two chunks per rank in a V."""
    sched = object.__new__(torch_schedules.ScheduleZBVZeroBubble)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = ranks, 2, microbatches
    sched.num_stages = 2 * ranks
    return {r: [str(a) for a in sched._calculate_single_rank_operations(r) if a is not None] for r in range(ranks)}


def torch_dualpipev_order(ranks: int, microbatches: int) -> dict[int, list[str]]:
    """DualPipeV: torch's ScheduleDualPipeV, each overlapped pair (OVERLAP_F_B) as its forward then
    its full backward, as atoll runs it."""
    sched = object.__new__(torch_schedules.ScheduleDualPipeV)
    sched.pp_group_size, sched._n_microbatches = ranks, microbatches
    order = {}
    for r in range(ranks):
        acts = [a for a in sched._calculate_single_rank_operations(r) if a is not None]
        order[r] = [str(x) for a in acts for x in (a.sub_actions or (a,))]
    return order


def torch_zero_bubble_order(ranks: int, microbatches: int) -> dict[int, list[str]]:
    """ZB-H1: torch's ScheduleInterleavedZeroBubble (its ZB1P) at one stage per rank, from the
    order it computes for every rank (its bubbles, None, left out)."""
    sched = object.__new__(torch_schedules.ScheduleInterleavedZeroBubble)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = ranks, 1, microbatches
    sched.number_of_rounds = max(1, microbatches // ranks)
    sched.microbatches_per_round = microbatches // sched.number_of_rounds
    return {r: [str(a) for a in sched._calculate_single_rank_operations(r) if a is not None] for r in range(ranks)}


@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s != "zb_h2"])  # torch has no ZB-H2: tests below
@pytest.mark.parametrize(("ranks", "microbatches"), SIZES)
def test_compute_order_matches_torch_pipelining(schedule, ranks, microbatches):
    topo = valid_topology(schedule, ranks, microbatches)
    if topo is None:
        return
    ours = {r: [str(a) for a in acts] for r, acts in build_schedule(topo).items()}
    if schedule == "interleaved_1f1b":
        theirs = torch_interleaved_order(ranks, topo.virtual_stages, microbatches)
    elif schedule == "zb_h1":
        theirs = torch_zero_bubble_order(ranks, microbatches)
    elif schedule == "zbv":
        theirs = torch_zbv_order(ranks, microbatches)
    elif schedule == "dualpipev":
        theirs = torch_dualpipev_order(ranks, microbatches)
    else:
        theirs = torch_single_stage_order(schedule, ranks, microbatches)
    assert ours == theirs


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("ranks", "microbatches"), SIZES)
def test_simulator_accepts_lowered_schedules(schedule, ranks, microbatches):
    topo = valid_topology(schedule, ranks, microbatches)
    if topo is None:
        return
    lowered = lower(build_schedule(topo), topo, chain_routes(topo))
    timeline = simulate(lowered.actions, topo, chain_routes(topo))
    assert 0 <= timeline.bubble_fraction < 1
    for actions in lowered.actions.values():
        assert actions[-1].kind is Kind.STEP
        for i, a in enumerate(actions):  # every receive is posted before the compute that reads it
            if a.kind is Kind.RECV_F:
                assert actions.index(Action(a.stage, Kind.FORWARD, a.microbatch)) > i
            if a.kind is Kind.RECV_B:  # DualPipeV splits some backwards and not others
                backward = next(
                    Action(a.stage, k, a.microbatch)
                    for k in (Kind.BACKWARD, Kind.BACKWARD_INPUT)
                    if Action(a.stage, k, a.microbatch) in actions
                )
                assert actions.index(backward) > i


# ----------------------------------------------------------------- golden text


def test_gpipe_two_ranks_golden():
    topo = Topology(ranks=2, microbatches=2, schedule="gpipe")
    lowered = lower(build_schedule(topo), topo, chain_routes(topo))
    text = {r: " ".join(map(str, acts)) for r, acts in lowered.actions.items()}
    # receives are posted one compute ahead of the compute that reads them
    assert text[0] == "0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0RECV_B1 0B0 0B1 0STEP"
    assert text[1] == "1RECV_F0 1RECV_F1 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1 1STEP"
    assert simulate(lowered.actions, topo, chain_routes(topo)).render() == (
        "rank 0: 0F0 0F1   .   .   . 0B0 0B0 0B1 0B1\nrank 1:   . 1F0 1F1 1B0 1B0 1B1 1B1   .   ."
    )


def test_1f1b_four_ranks_golden():
    topo = Topology(ranks=4, microbatches=8, schedule="1f1b")
    order = {r: " ".join(map(str, acts)) for r, acts in build_schedule(topo).items()}
    assert order[0] == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7"
    assert order[3] == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7"


def test_actions_print_and_parse():
    for text in ["2F5", "0B3", "1SEND_F0", "3RECV_B12", "0STEP"]:
        assert str(Action.parse(text)) == text
    for bad in ["F5", "2X5", "0STEP3", "1SEND_F", ""]:
        with pytest.raises(ValueError):
            Action.parse(bad)


# ----------------------------------------------------------------- deadlocks


def _lowered_gpipe(ranks=2, microbatches=4):
    topo = Topology(ranks=ranks, microbatches=microbatches, schedule="gpipe")
    return topo, {r: list(a) for r, a in lower(build_schedule(topo), topo, chain_routes(topo)).actions.items()}


def test_simulator_rejects_swapped_send_and_recv_naming_the_blocked_worker():
    topo, actions = _lowered_gpipe()
    last = actions[1]
    i, j = last.index(Action.parse("1RECV_F0")), last.index(Action.parse("1SEND_B0"))
    last[i], last[j] = last[j], last[i]
    with pytest.raises(ScheduleError) as err:
        simulate(actions, topo, chain_routes(topo))
    message = str(err.value)
    assert "deadlocks" in message
    assert "worker rank 1 blocks at action #0 '1SEND_B0': sends the result of 1B0, which has not run" in message
    assert "worker rank 0 blocks at action" in message and "waits for 1SEND_B0 on rank 1" in message


def test_simulator_finds_a_circular_wait():
    topo, actions = _lowered_gpipe(microbatches=1)
    first = actions[0]  # move rank 0's send of microbatch 0 after its backward: both ranks wait forever
    send = first.pop(first.index(Action.parse("0SEND_F0")))
    first.insert(first.index(Action.parse("0B0")) + 1, send)
    with pytest.raises(ScheduleError) as err:
        simulate(actions, topo, chain_routes(topo))
    message = str(err.value)
    assert "worker rank 0 blocks at action #2 '0B0': waits for 1SEND_B0 on rank 1" in message
    assert "worker rank 1 blocks at action #1 '1F0': waits for 0SEND_F0 on rank 0" in message


def test_simulator_rejects_missing_and_misplaced_actions():
    topo, actions = _lowered_gpipe()
    actions[1].remove(Action.parse("1RECV_F2"))
    with pytest.raises(ScheduleError, match="its receive 1RECV_F2 is not posted before it"):
        simulate(actions, topo, chain_routes(topo))
    topo, actions = _lowered_gpipe()
    actions[0].remove(Action.parse("0B3"))
    with pytest.raises(ScheduleError, match="never runs 0B3"):
        simulate(actions, topo, chain_routes(topo))
    topo, actions = _lowered_gpipe()
    actions[0].insert(0, Action.parse("1F0"))
    with pytest.raises(ScheduleError, match="stage 1 does not live on rank 0"):
        simulate(actions, topo, chain_routes(topo))


# ----------------------------------------------------------------- slots and topology


def test_receive_slots_follow_the_schedule_memory():
    for schedule, expected_forward_slots in [("gpipe", 8), ("1f1b", 2)]:
        topo = Topology(ranks=4, microbatches=8, schedule=schedule)
        lowered = lower(build_schedule(topo), topo, chain_routes(topo))
        owners = lowered.slot_owner[3].values()
        # the last rank holds every microbatch's input under GPipe; under 1F1B one, plus one prefetched
        assert sum(1 for _, kind in owners if kind is Kind.RECV_F) == expected_forward_slots


def test_topology_refuses_bad_values():
    with pytest.raises(InvalidInput, match="unknown schedule"):
        Topology(ranks=2, microbatches=2, schedule="zigzag")
    with pytest.raises(InvalidInput, match="ranks must be a positive integer"):
        Topology(ranks=0, microbatches=2)
    with pytest.raises(InvalidInput, match="needs 'interleaved_1f1b'"):
        Topology(ranks=2, virtual_stages=2, microbatches=4, schedule="1f1b")
    with pytest.raises(InvalidInput, match="divisible by the number of rounds"):
        Topology(ranks=2, virtual_stages=2, microbatches=5, schedule="interleaved_1f1b")
    topo = Topology(ranks=3, virtual_stages=2, microbatches=6, schedule="interleaved_1f1b")
    assert topo.num_stages == 6 and topo.stages_of(1) == [1, 4] and topo.stage_ranks == [0, 1, 2, 0, 1, 2]


def test_stages_on_one_rank_hand_off_locally_golden():
    topo = Topology(ranks=1, virtual_stages=2, microbatches=2, schedule="interleaved_1f1b")
    lowered = lower(build_schedule(topo), topo, chain_routes(topo))
    assert " ".join(map(str, lowered.actions[0])) == "0F0 1F0 1B0 0F1 0B0 1F1 1B1 0B1 0STEP"
    assert lowered.recv_slots[0] == {}  # no transport, no receive buffer
    simulate(lowered.actions, topo, chain_routes(topo))
    swapped = [Action(1, Kind.FORWARD, 0), Action(0, Kind.FORWARD, 0), *lowered.actions[0][2:]]
    with pytest.raises(ScheduleError, match=r"rank 0 blocks at action #0 '1F0': waits for 0F0, not yet run"):
        simulate({0: swapped}, topo, chain_routes(topo))


# ----------------------------------------------------------------- dataflow graphs (skip edges, tied parameters)


def _skip_routes(topo: Topology, tied: bool = False) -> Routes:
    """Three stages; stage 0's output also goes straight to stage 2 (a residual); with ``tied``,
    stages 0 and 2 share a parameter."""
    x = EdgeSpec("x", (TensorSpec((1,), "float32"),))
    edges = (
        Edge(BATCH, 0, (0,), (0,), x),
        Edge(0, 1, (0,), (0,), x),
        Edge(0, 2, (0,), (1,), x),
        Edge(1, 2, (0,), (0,), x),
    )
    shared = (TiedParameter("w", (0, 2), TensorSpec((1,), "float32")),) if tied else ()
    return Routes(Dataflow(3, edges, shared), topo.stage_ranks)


def test_skip_edge_is_received_directly_from_its_producer():
    topo = Topology(ranks=3, microbatches=2, schedule="1f1b")
    routes = _skip_routes(topo, tied=True)
    lowered = lower(build_schedule(topo), topo, routes)
    text = {r: " ".join(map(str, acts)) for r, acts in lowered.actions.items()}
    # rank 2 receives both edges with one RECV_F per microbatch and sends gradients back to both
    assert [t.shape for t in routes.recv_f_specs(2)] == [(1,), (1,)]
    assert routes.sends_b(2) and {e.src for _, e in routes.remote_in(2)} == {0, 1}
    assert text[0].endswith("0REDUCE_GRAD 0STEP") and text[2].endswith("2REDUCE_GRAD 2STEP")
    assert "REDUCE_GRAD" not in text[1]
    timeline = simulate(lowered.actions, topo, routes)
    assert 0 < timeline.bubble_fraction < 1


def test_simulator_names_the_worker_blocked_on_a_skip_edge():
    topo = Topology(ranks=3, microbatches=1, schedule="gpipe")
    routes = _skip_routes(topo)
    actions = {r: list(a) for r, a in lower(build_schedule(topo), topo, routes).actions.items()}
    actions[2].remove(Action.parse("2RECV_F0"))  # a missing receive
    with pytest.raises(ScheduleError, match=r"worker rank 2 blocks at action #0 '2F0': its receive 2RECV_F0 is not"):
        simulate(actions, topo, routes)
    actions = {r: list(a) for r, a in lower(build_schedule(topo), topo, routes).actions.items()}
    first = actions[0]  # crossed: rank 0 sends only after its backward, which waits on stage 2's gradient
    send = first.pop(first.index(Action.parse("0SEND_F0")))
    first.insert(first.index(Action.parse("0B0")) + 1, send)
    with pytest.raises(ScheduleError) as err:
        simulate(actions, topo, routes)
    assert "worker rank 0 blocks at action #2 '0B0': waits for 1SEND_B0 on rank 1" in str(err.value)
    assert "worker rank 1 blocks at action #2 '1F0': waits for 0SEND_F0 on rank 0" in str(err.value)
    assert "worker rank 2 blocks at action #1 '2F0': waits for 0SEND_F0 on rank 0" in str(err.value)


def test_simulator_requires_reduce_grad_on_every_holder_of_a_tied_parameter():
    topo = Topology(ranks=3, microbatches=1, schedule="gpipe")
    routes = _skip_routes(topo, tied=True)
    actions = {r: list(a) for r, a in lower(build_schedule(topo), topo, routes).actions.items()}
    actions[2].remove(Action.parse("2REDUCE_GRAD"))
    with pytest.raises(ScheduleError, match="rank 0 blocks at action .*'0REDUCE_GRAD': rank 2 holds a tied param"):
        simulate(actions, topo, routes)


def test_every_schedule_name_has_a_builder_and_no_builder_lacks_a_name():
    assert tuple(BUILDERS) == SCHEDULES


@pytest.mark.parametrize(("ranks", "microbatches"), [(1, 2), (2, 5), (3, 7), (4, 11)])
def test_dualpipev_runs_every_backward_once_in_torch_order(ranks, microbatches):
    """DualPipeV at sizes the grid above does not reach: torch's order, and each stage's microbatch
    gets one full backward or one input half and one weight half, the weight half after it."""
    topo = topology("dualpipev", ranks, microbatches)
    schedule = build_schedule(topo)
    assert {r: [str(a) for a in acts] for r, acts in schedule.items()} == torch_dualpipev_order(ranks, microbatches)
    for r, acts in schedule.items():
        for stage in topo.stages_of(r):
            for m in range(microbatches):
                mine = [a.kind for a in acts if a.stage == stage and a.microbatch == m]
                assert mine in (
                    [Kind.FORWARD, Kind.BACKWARD],
                    [Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT],
                )
    lowered = lower(schedule, topo, chain_routes(topo))
    assert 0 <= simulate(lowered.actions, topo, chain_routes(topo)).bubble_fraction < 1


def test_zb_h2_golden():
    """ZB-H2 at 2 ranks: rank 0 runs 3 forwards before its first input half (ZB-H1: 2), the last
    rank starts its weight halves 3 microbatches late (2r, and one more on the last rank; ZB-H1: 1)."""
    order = {r: " ".join(map(str, acts)) for r, acts in build_schedule(topology("zb_h2", 2, 4)).items()}
    assert order[0] == "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3"
    assert order[1] == "1F0 1I0 1F1 1I1 1F2 1I2 1F3 1I3 1W0 1W1 1W2 1W3"
    h1 = {r: " ".join(map(str, acts)) for r, acts in build_schedule(topology("zb_h1", 2, 4)).items()}
    assert h1[0] == "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0F3 0I2 0W2 0I3 0W3"
    assert h1[1] == "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1F3 1I3 1W2 1W3"


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 8), (4, 8), (4, 16), (8, 24)])
def test_zb_h2_steps_back_to_back_have_no_bubble_at_equal_costs(ranks, microbatches):
    """At equal F, I and W costs and free transfers, a ZB-H2 step that follows another keeps every
    rank busy (its parallelogram fits the one before); ZB-H1's does not. A lone step has a bubble
    either way (the last rank waits for the first forward). ZB-H2 stashes 2(P - r) - 1
    microbatches on rank r before its first input half."""
    unit = lambda a: 1.0 if a.is_compute else 0.0  # noqa: E731
    steps = {}
    for schedule in ("zb_h1", "zb_h2"):
        topo = topology(schedule, ranks, microbatches)
        lowered = lower(build_schedule(topo), topo, chain_routes(topo))
        steps[schedule] = steady_step(lowered.actions, topo, chain_routes(topo), unit)
        assert simulate(lowered.actions, topo, chain_routes(topo), unit).bubble_fraction > 0
    assert (steps["zb_h2"].step, steps["zb_h2"].bubble_fraction) == (3 * microbatches, 0.0)
    assert steps["zb_h2"].lone > 3 * microbatches  # alone, a step has its fill and drain
    assert steps["zb_h1"].step == steps["zb_h1"].lone > 3 * microbatches and steps["zb_h1"].bubble_fraction > 0
    for r, acts in build_schedule(topology("zb_h2", ranks, microbatches)).items():
        first_input_half = next(i for i, a in enumerate(acts) if a.kind is Kind.BACKWARD_INPUT)
        assert first_input_half == min(2 * (ranks - r) - 1, microbatches)
        first_weight_half = next(i for i, a in enumerate(acts) if a.kind is Kind.BACKWARD_WEIGHT)
        input_halves_before = sum(a.kind is Kind.BACKWARD_INPUT for a in acts[:first_weight_half])
        assert input_halves_before == min(2 * r + 1 + (r == ranks - 1), microbatches)
