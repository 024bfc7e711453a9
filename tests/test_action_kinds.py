"""A new action kind is one declaration (atoll.core.actions.declare) and one handler
(atoll.worker.executor.handlers.handles): the simulator, the memory plan, the communication count,
the timelines, the wire form and the executor all take it without another edit.

The kind added here clips the gradients' global norm before the optimizer step, a local, once-per-step
action; the executor runs it in one process and its weights match a plain PyTorch loop that clips
the same way (float64, AdamW)."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from atoll.client.export import export_pipeline
from atoll.controller.compiler import communication, simulate
from atoll.controller.compiler import memory as memory_plan
from atoll.controller.compiler.pipeline import PipelineRequest, compile_pipeline
from atoll.core.actions import Action, Kind, declare, kind_of, kinds
from atoll.core.config import JobConfig, WorkerSettings
from atoll.core.graphs import BlockGraph, StageGraph, deserialize
from atoll.errors import InvalidInput
from atoll.worker.executor.handlers import handles
from atoll.worker.executor.interpreter import PipelineExecutor, StageSetup
from atoll.worker.executor.run import StepRun
from atoll.worker.executor.step import StepState

MAX_NORM = 0.05
CLIP = declare("CLIP_GRAD_NORM", "CLIP", "local", per_step=True, cost=0.5)
ORPHAN = declare("ORPHAN", "ORPHAN", "local", per_step=True)  # no handler anywhere


@handles(CLIP)
def clip_grad_norm(ex, action, state):
    torch.nn.utils.clip_grad_norm_(ex.params, MAX_NORM)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _compiled(model, x, y, microbatches=2):
    p = export_pipeline(model, x, y, F.mse_loss, microbatches)
    config = JobConfig(stages=1, microbatches=microbatches, optimizer="adamw", optimizer_args={"lr": 0.01})
    return compile_pipeline(
        PipelineRequest(model=p.model, aliases=p.aliases, loss=p.loss, input=p.input, target=p.target, config=config)
    )


def _with_clip(actions):
    step = actions[-1]
    assert step.kind is Kind.STEP
    return [*actions[:-1], Action(step.stage, CLIP), step]


def test_the_declaration_gives_the_wire_form_and_the_printed_form():
    a = Action(0, CLIP)
    assert str(a) == "0CLIP" and Action.parse("0CLIP") == a
    assert Action.from_pb(a.to_pb()) == a
    assert pickle.loads(pickle.dumps(a)).kind is CLIP and copy.deepcopy(a).kind is CLIP
    assert kind_of("CLIP") is CLIP and CLIP in kinds()
    with pytest.raises(ValueError, match="take no microbatch"):
        Action.parse("0CLIP3")
    with pytest.raises(ValueError, match="declared already"):
        declare("CLIP_GRAD_NORM", "CLIP", "local")
    with pytest.raises(ValueError, match="has a handler already"):
        handles(CLIP)(clip_grad_norm)


def test_simulate_memory_and_communication_read_the_declaration():
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    compiled = _compiled(_model(), x, y)
    plain = compiled.lowered.actions[0]
    clipped = _with_clip(plain)
    timeline = simulate.simulate({0: clipped}, compiled.topology, compiled.routes)
    (span,) = [s for s in timeline.spans[0] if s.action.kind is CLIP]
    assert span.end - span.start == CLIP.cost  # its declared cost, after the last backward
    last_backward = max(s.end for s in timeline.spans[0] if s.action.kind is Kind.BACKWARD)
    assert span.start == last_backward
    base = simulate.simulate({0: plain}, compiled.topology, compiled.routes)
    assert timeline.makespan == base.makespan + CLIP.cost

    stage_memory = {0: compiled.stages[0].memory}
    assert memory_plan.predict_rank(clipped, stage_memory, 100, 10) == memory_plan.predict_rank(
        plain, stage_memory, 100, 10
    )
    params = list(_model().parameters())
    assert communication.predict_rank(clipped, compiled.routes, 0, params, 1) == communication.predict_rank(
        plain, compiled.routes, 0, params, 1
    )


def _executor(compiled, actions):
    stage = compiled.stages[0]
    setup = StageSetup(
        index=0,
        graph=StageGraph(BlockGraph("stage 0", deserialize(stage.programs[0], "stage 0 program"))),
        input=stage.input,
        output=stage.output,
    )
    loss = BlockGraph("loss", deserialize(compiled.loss_programs[0], "loss program"))
    return PipelineExecutor(
        rank=0,
        stages=[setup],
        loss=loss,
        routes=compiled.routes,
        actions=actions,
        recv_slots={},
        settings=WorkerSettings.of(compiled.request.config),
        transport=None,
        device=torch.device("cpu"),
    )


def test_the_executor_runs_the_new_kind_and_matches_pytorch():
    """Tolerance 1e-12 in float64: the same arithmetic in another order (microbatch sums)."""
    model = _model()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    compiled = _compiled(model, x, y)
    executor = _executor(compiled, _with_clip(compiled.lowered.actions[0]))
    opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(1)
    clipped_norms = []
    for step in range(1, 4):
        xb, yb = (
            torch.randn(8, 6, generator=data, dtype=torch.float64),
            torch.randn(8, 3, generator=data, dtype=torch.float64),
        )
        losses, _, _ = executor.run_step([xb], [yb], step=step)
        opt.zero_grad()
        want = [F.mse_loss(reference(xm), ym) for xm, ym in zip(xb.chunk(2), yb.chunk(2))]
        (sum(want) / 2).backward()
        clipped_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)))
        opt.step()
        assert losses == pytest.approx([w.item() for w in want], rel=0, abs=1e-12)
    assert min(clipped_norms) > MAX_NORM  # the clip changed every step's update
    got = executor.state_dict()
    for name, want in reference.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=0, atol=1e-12)
    spans = executor.history.select([], 1)[0].spans
    assert ("0CLIP", "local") in {(n, c) for n, c, _, _ in spans}


def test_a_step_trains_whatever_autograds_mode_in_its_thread_and_leaves_that_mode_as_it_was():
    """run_step sets autograd's mode once for the step; StepRun.advance sets it for an action only
    where the thread's differs, as in an interleaving thread that runs other jobs' steps too.
    Float64 AdamW against PyTorch at 1e-12: the same arithmetic in another order."""
    model = _model()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    compiled = _compiled(model, x, y)
    executor = _executor(compiled, compiled.lowered.actions[0])
    with torch.no_grad():  # a training step in a thread with autograd off
        executor.run_step([x], [y], step=1)
        assert not torch.is_grad_enabled()
    trained = executor.state_dict()
    evaluated = executor.run_step([x], [y], mode="evaluate", step=2)[0]  # autograd on: nothing recorded
    assert torch.is_grad_enabled()
    for name, want in trained.items():
        torch.testing.assert_close(executor.state_dict()[name], want, rtol=0, atol=0)
    run = StepRun(executor, StepState("train", executor._split([x]), executor._split([y])))
    with torch.no_grad():  # an action at a time, as an interleaver runs it
        while run.advance():
            pass
        assert not torch.is_grad_enabled()
    run.close()
    opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for step in range(3):
        opt.zero_grad()
        want = [F.mse_loss(reference(xm), ym) for xm, ym in zip(x.chunk(2), y.chunk(2))]
        if step == 1:
            assert evaluated == pytest.approx([w.item() for w in want], rel=0, abs=1e-12)
            continue
        (sum(want) / 2).backward()
        opt.step()
    for name, want in reference.state_dict().items():
        torch.testing.assert_close(executor.state_dict()[name], want, rtol=0, atol=1e-12)


def test_a_kind_without_a_handler_is_refused_when_the_plan_loads():
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    compiled = _compiled(_model(), x, y)
    actions = compiled.lowered.actions[0]
    with pytest.raises(InvalidInput, match="no handler for action kind ORPHAN"):
        _executor(compiled, [*actions[:-1], Action(0, ORPHAN), actions[-1]])
