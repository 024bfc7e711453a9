"""What a program may be, checked where it is built, with messages that name the stage (no cluster):
values of another program, cycles, dead stages, a stage that does not fit what it reads, and one
definition of a skip edge."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import atoll
from atoll.client.export import export_pipeline
from tests.models import compile_locally

X, Y = torch.randn(8, 12), torch.randint(0, 3, (8,))


def _program():
    p = atoll.Program()
    return p, p.input("x", X), p.input("y", Y)


def test_the_loss_takes_values_of_its_own_program_only():
    other = atoll.Program()
    foreign = other.stage(nn.Linear(12, 3), other.input("x", X))
    p, x, y = _program()
    p.stage(nn.Linear(12, 3), x)
    with pytest.raises(atoll.InvalidInput, match="the loss's output is a value of another program"):
        p.loss(F.cross_entropy, foreign, y)
    with pytest.raises(atoll.InvalidInput, match="the loss's target is a value of another program"):
        p.loss(F.cross_entropy, p.stage(nn.Linear(3, 3), atoll.Value(p, "stage", "s0")), other.input("y", Y))
    with pytest.raises(atoll.InvalidInput, match="stage 's2': argument 0 is a value of another program"):
        p.stage(nn.Linear(12, 3), foreign)


def test_a_cycle_is_refused_as_a_cycle_naming_its_stages():
    p, x, y = _program()
    first = p.stage(nn.Bilinear(12, 12, 12), x, atoll.Value(p, "stage", "s1"))  # reads s1, made after it
    second = p.stage(nn.Linear(12, 3), first)
    p.loss(F.cross_entropy, second, y)
    with pytest.raises(atoll.InvalidInput, match=r"the program has a cycle: s0 -> s1 -> s0"):
        p.module()


def test_an_unknown_stage_and_a_stage_reading_the_target_are_named():
    p, x, y = _program()
    p.loss(F.cross_entropy, p.stage(nn.Linear(12, 3), atoll.Value(p, "stage", "nowhere")), y)
    with pytest.raises(atoll.InvalidInput, match="stage 's0' reads 'nowhere', which is no stage of this program"):
        p.module()
    p, x, y = _program()
    p.loss(F.cross_entropy, p.stage(nn.Embedding(3, 3), y), y)
    with pytest.raises(atoll.InvalidInput, match="stage 's0' reads 'y', the loss's target: only the loss may"):
        p.module()


@pytest.mark.parametrize("where", ["middle", "end"])
def test_a_stage_nothing_reads_is_refused_wherever_it_stands(where):
    p, x, y = _program()
    first = p.stage(nn.Linear(12, 3), x)
    if where == "middle":
        p.stage(nn.Linear(12, 3), x, name="dead")
        last = p.stage(nn.Linear(3, 3), first)
    else:
        last = p.stage(nn.Linear(3, 3), first)
        p.stage(nn.Linear(12, 3), x, name="dead")
    p.loss(F.cross_entropy, last, y)
    with pytest.raises(atoll.InvalidInput, match=r"stage 'dead': nothing reads its output"):
        p.module()


def test_a_stage_that_does_not_fit_what_it_reads_is_named_with_both_specs(capfd):
    p, x, y = _program()
    encoded = p.stage(nn.Linear(12, 5), x, name="encode")
    head = p.stage(nn.Sequential(nn.Linear(7, 3)), encoded, name="head")
    p.loss(F.cross_entropy, head, y)
    with pytest.raises(atoll.InvalidInput) as failed:
        export_pipeline(p.module(), X, Y, p.loss_fn, 2)
    assert "torch.export failed" in str(failed.value)  # what torch alone can say
    with pytest.raises(atoll.InvalidInput) as named:
        p.check_stages(2)
    message = str(named.value)
    assert message.startswith("stage 'head' (Sequential) fails on what it reads: the output of stage 'encode'")
    assert "float32[4, 5]" in message and "Linear(in_features=7) takes a floating tensor [..., 7]" in message
    assert "fake_tensor" not in capfd.readouterr().err  # torch's tracebacks go to atoll's log at DEBUG


def test_torch_log_lines_of_a_failed_export_go_to_atolls_debug_log(caplog):
    p, x, y = _program()
    p.loss(F.cross_entropy, p.stage(nn.Sequential(nn.Linear(12, 5), nn.Linear(7, 3)), x), y)
    with caplog.at_level("DEBUG", logger="atoll.export"), pytest.raises(atoll.InvalidInput):
        export_pipeline(p.module(), X, Y, p.loss_fn, 2)
    assert any("fake_tensor" in r.getMessage() for r in caplog.records if r.name == "atoll.export")


def _dataflow(program, stages: int) -> list[dict]:
    x, y = program.example_batch()
    split_at = tuple(program.split_at())
    compiled = compile_locally(
        program.module(), x, y, program.loss_fn, stages=stages, microbatches=2, split_at=split_at
    )
    return compiled.report()["dataflow"]


def test_skip_means_the_same_for_every_edge_batch_inputs_included():
    """A skip edge bypasses at least one stage in topological order: the residual 0 -> 2, and the
    batch input that only the last stage reads, alike."""
    p = atoll.Program()
    x, z, y = p.input("x", X), p.input("z", torch.randn(8, 3)), p.input("y", Y)
    a = p.stage(nn.Linear(12, 12), x)
    b = p.stage(nn.Linear(12, 12), a)
    out = p.stage(nn.Bilinear(12, 3, 3), b, z)  # z: read by the last stage only
    p.loss(F.cross_entropy, p.stage(nn.Bilinear(3, 12, 3), out, a), y)  # a: also read two stages on
    flow = {(e["from_stage"], e["to_stage"]): e["skip"] for e in _dataflow(p, 4)}
    assert flow[("input", 0)] is False and flow[(0, 1)] is False and flow[(2, 3)] is False
    assert flow[("input", 2)] is True  # the batch input skips stages 0 and 1
    assert flow[(0, 3)] is True
