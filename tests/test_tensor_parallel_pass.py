"""The tensor-parallel compiler pass on its own, without processes: how it cuts parameters and
reshapes, and the sharded programs of every island rank run side by side in threads (an
in-memory all-reduce standing in for the island's gloo group) against the unsharded model:
same loss, same gradients (1e-5 relative)."""

import threading

import pytest
import torch

from atoll.client.export import export_pipeline
from atoll.controller.compiler.parallel.tensor import shard_stage
from atoll.controller.compiler.parallel.tensor.propagate import _view_dim
from atoll.controller.compiler.simulate import ScheduleError, check_islands, island_order
from atoll.controller.compiler.split import split_model
from atoll.core import collectives
from atoll.core.actions import Action
from atoll.core.graphs import BlockGraph, deserialize
from atoll.core.shards import ParamShard
from atoll.errors import InvalidInput
from tests import models
from tests.reference import relative_error


class _ThreadIsland:
    """All-reduce among threads, one per island rank (a test double for the gloo group)."""

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots = [None] * size

    def member(self, rank: int):
        island = self

        class Member:
            world_size = len(island.slots)

            def all_gather_into(self, outputs, tensor):
                island.slots[rank] = tensor.clone()
                island.barrier.wait()
                for out, part in zip(outputs, island.slots):
                    out.copy_(part)
                island.barrier.wait()

            def all_reduce(self, tensor, op):
                island.slots[rank] = tensor.clone()
                island.barrier.wait()
                reduce = torch.maximum if op == "max" else torch.add
                total = island.slots[0]
                for other in island.slots[1:]:
                    total = reduce(total, other)
                island.barrier.wait()
                tensor.copy_(total)

        member = Member()
        member.rank = rank
        return member


def test_a_parameter_cut_in_blocks_joins_back_whole():
    full = torch.arange(12 * 3).reshape(12, 3)
    cut = ParamShard(0, (4, 8))  # e.g. two projections fused into one weight
    pieces = [cut.local(full, t, 2) for t in range(2)]
    assert pieces[0].tolist() == full[[0, 1, 4, 5, 6, 7]].tolist()
    assert torch.equal(cut.join(pieces), full)


def test_reshapes_carry_the_sharded_dimension_or_name_the_heads():
    assert _view_dim((8, 16, 96), 2, (8, 16, 4, 24), 2, "m") == 2  # features -> heads
    assert _view_dim((8, 16, 4, 8), 2, (8, 16, 32), 2, "m") == 2  # heads -> features
    assert _view_dim((8, 16, 32), 2, (128, 32), 2, "m") == 1  # tokens flattened
    assert _view_dim((8, 16, 32), 1, (128, 32), 2, "m") is None  # the sequence mixed with the batch
    with pytest.raises(InvalidInput, match="tensor_parallel=4 does not divide the 6 heads"):
        _view_dim((8, 16, 48), 2, (8, 16, 6, 8), 4, "'1'")


def _gpt():
    return models.transformer(layers=2)


def _hf_gpt2():
    model, batches = models.hf_gpt2(pytest.importorskip("transformers"))
    return model, batches, models.lm_loss


def _hf_llama(family: str):
    def make():
        model, batches = models.hf_llama(pytest.importorskip("transformers"), family)
        return model, batches, models.lm_loss

    return make


@pytest.mark.parametrize(
    "make, ranks, sequence",
    [
        (_gpt, 2, False),
        (_gpt, 4, False),
        (_gpt, 2, True),
        (_gpt, 4, True),
        (_hf_gpt2, 2, False),
        (_hf_gpt2, 2, True),
        (_hf_llama("llama"), 2, False),
        (_hf_llama("llama-bias"), 2, False),
        (_hf_llama("mistral"), 2, False),
        (_hf_llama("llama"), 2, True),
        (models.fused_gate_up, 2, False),
    ],  # fmt: skip
    ids=[
        "gpt-tp2",
        "gpt-tp4",
        "gpt-tp2-sp",
        "gpt-tp4-sp",
        "hf-gpt2-tp2",
        "hf-gpt2-tp2-sp",
        "hf-llama-tp2",
        "hf-llama-bias-tp2",
        "hf-mistral-tp2",
        "hf-llama-tp2-sp",
        "fused-gate-up-tp2",
    ],  # fmt: skip
)
def test_sharded_programs_match_the_whole_model(make, ranks, sequence):
    model, batches, loss_fn = make()
    x, y = batches[0]
    exported = export_pipeline(model, x, y, loss_fn, 1)
    program = split_model(exported.model, exported.input, 1, [], exported.aliases).stages[0].program
    stage, losses = shard_stage(program, 0, ranks, {}, [x], True, exported.loss, exported.target, sequence)
    if make is models.fused_gate_up:  # gate and up, each cut by features
        assert stage.params["gate_up_proj.weight"] == ParamShard(0, (64, 64))
        assert stage.modules["down_proj"] == "rowwise"
    if make is _gpt:
        assert stage.params["1.qkv.weight"] == ParamShard(0, (32, 32, 32))
        assert stage.params["1.proj.weight"] == ParamShard(1, (32,))
        assert stage.modules["0.tokens"] == "vocab_embedding" and "0.positions.weight" not in stage.params
    ops = {c["op"] for part in stage.collectives.values() for c in part}
    assert ("reduce_scatter" in ops and "all_gather" in ops) == sequence

    reference = loss_fn(model(x), y)
    reference.backward()
    programs = [
        (BlockGraph("stage", deserialize(stage.programs[t], "s")), BlockGraph("loss", deserialize(losses[t], "l")))
        for t in range(ranks)
    ]
    island, results = _ThreadIsland(ranks), [None] * ranks

    def run(t):
        graph, loss_graph = programs[t]
        member = island.member(t)
        with collectives.bind(member):
            (loss,) = loss_graph.call_flat([*graph.call_flat([x]), y])  # flat outputs: the loss alone
            loss.backward()
            moved = collectives.take_counted_bytes(member)
        results[t] = (loss.item(), dict(graph.module.named_parameters()), moved)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(r is not None for r in results), "a rank failed"
    expected_bytes = sum(stage.bytes(part) for part in ("forward", "backward", "loss_forward"))
    for loss, _, moved in results:
        assert abs(loss - reference.item()) <= 1e-5 * abs(reference.item())
        assert moved == expected_bytes  # what the plan reports is what runs
    for name, p in model.named_parameters():
        pieces = [r[1][name].grad for r in results]
        got = stage.params[name].join(pieces) if name in stage.params else pieces[0]
        assert relative_error(got, p.grad) <= 1e-5, name


def test_an_island_whose_ranks_disagree_on_collectives_is_refused():
    f0, b0 = Action.parse("0F0"), Action.parse("0B0")
    same = {"forward": [{"op": "all_reduce_sum", "shape": [4, 8], "bytes": 128}], "backward": []}
    other = {"forward": [{"op": "all_reduce_sum", "shape": [4, 4], "bytes": 64}], "backward": []}
    orders = {t: island_order([f0, b0], {0: c}, 0) for t, c in enumerate([same, same])}
    check_islands(orders, "pipeline rank 0")  # the same order: fine
    orders[1] = island_order([f0, b0], {0: other}, 0)
    with pytest.raises(ScheduleError, match=r"island rank 1 would deadlock at collective #0: it runs 0F0"):
        check_islands(orders, "pipeline rank 0")


class _CumulativeFeatures(torch.nn.Module):
    """A linear whose features go through an op tensor parallelism does not follow (cumsum)."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.head = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.down(torch.cumsum(self.up(x), dim=-1)))


def test_a_linear_left_whole_is_named_with_the_undivided_share_and_strict_refuses_it():
    torch.manual_seed(0)
    model, x, y = _CumulativeFeatures(), torch.randn(8, 16), torch.randn(8, 4)
    loss = torch.nn.functional.mse_loss
    report = models.compile_locally(model, x, y, loss, stages=1, microbatches=2, tensor_parallel=2).report({})
    (stage,) = report["stages"]
    tp = stage["tensor_parallel"]
    assert tp["whole_linear_layers"] == {"up": "cumsum.default is not known to tensor parallelism"}
    assert tp["modules"]["down"] == "colwise" and tp["modules"]["head"] == "rowwise"
    params = {n: p.numel() for n, p in model.named_parameters()}
    cut = sum(params[n] for n in ("down.weight", "down.bias", "head.weight"))
    assert tp["sharded_fraction"]["parameters"] == round(cut / sum(params.values()), 4)
    flops = {"up": 2 * 4 * 16 * 64, "down": 2 * 4 * 64 * 16, "head": 2 * 4 * 16 * 4}  # per microbatch of 4 rows
    assert tp["sharded_fraction"]["forward_flops"] == round((flops["down"] + flops["head"]) / sum(flops.values()), 4)
    (warning,) = report["warnings"]
    assert "1 linear layer(s) of stage 0 whole on every rank (up: cumsum.default" in warning
    assert f"{1 - tp['sharded_fraction']['parameters']:.0%} of the stage's parameters" in warning
    with pytest.raises(InvalidInput, match="up: cumsum.default .*tensor_parallel_strict refuses this"):
        models.compile_locally(
            model, x, y, loss, stages=1, microbatches=2, tensor_parallel=2, tensor_parallel_strict=True
        )
    # a layer the plan keeps whole on purpose is no warning, strict or not
    kept = {"up": "replicate"}
    plain = models.compile_locally(
        model, x, y, loss, stages=1, microbatches=2, tensor_parallel=2, tensor_parallel_plan=kept,
        tensor_parallel_strict=True,
    )  # fmt: skip
    assert plain.report({})["warnings"] == []


def test_a_backward_on_another_thread_runs_on_the_island_its_forward_saw():
    """Autograd runs a CUDA backward on a device thread of its own, where no island is bound: the
    ops whose backward communicates keep their forward's island, and the bytes count for it."""
    member = _ThreadIsland(1).member(0)
    x = torch.randn(4, 8, requires_grad=True)
    with collectives.bind(member):
        y = collectives.island_copy(x)  # backward: an all-reduce over the island
        z = collectives.island_gather(y, 0, 1)  # backward: a reduce-scatter
        assert collectives.take_counted_bytes(member) == x.nbytes  # the forward's gather
    errors = []

    def backward():
        try:
            z.sum().backward()
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    thread = threading.Thread(target=backward)
    thread.start()
    thread.join(30)
    assert not errors, errors
    assert torch.equal(x.grad, torch.ones(4, 8))
    assert collectives.take_counted_bytes(member) == 2 * x.nbytes  # both backwards' collectives
    with pytest.raises(RuntimeError, match="no island group bound"):
        collectives.island_all_reduce(x.detach())  # a forward outside any island still refuses


def test_a_dead_islands_uncounted_bytes_never_reach_another():
    """Counted bytes belong to their group object: a group dropped before its bytes were taken
    leaves none to a later one, even one CPython places at the same address (keyed by ``id``, a
    CI run once counted 147456 bytes too many in the test above)."""

    class Group:
        pass

    for _ in range(20):
        dropped = Group()
        collectives._count(dropped, 100)
        del dropped
        assert collectives.take_counted_bytes(Group()) == 0
    kept = Group()
    collectives._count(kept, 100)
    collectives._count(kept, 28)
    assert collectives.take_counted_bytes(kept) == 128 and collectives.take_counted_bytes(kept) == 0
