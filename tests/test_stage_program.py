"""Stage programs built from the split graph (controller/compiler/stage_program.py) against the
same stages exported again by torch.export, the path they replace: the same operations in the same
order, the same signature, state and constants, bit-identical outputs and parameter gradients, and
the same tensor-parallel cut. A stage with an in-place operation is left to torch.export."""

import threading

import pytest
import torch
import torch.utils._pytree as pytree

import atoll.controller.compiler.split as split
import atoll.controller.compiler.stage_program as stage_program
from atoll.client.export import export_pipeline
from atoll.controller.compiler.parallel.tensor import shard_stage
from atoll.controller.compiler.passes import microbatch_spec
from atoll.core import collectives
from atoll.core.graphs import deserialize, export, graph_module, serialize
from examples.gpt import lm_loss
from tests import models


def _zoo(name: str):
    if name in ("mlp", "transformer", "skip_net", "tied_lm", "fused_gate_up"):
        return getattr(models, name)()
    if name == "char_gpt":
        return (*models.char_gpt(layers=2), lm_loss)
    transformers = pytest.importorskip("transformers")
    if name == "hf_gpt2":
        return (*models.hf_gpt2(transformers), lm_loss)
    return (*models.hf_llama(transformers, "mistral"), lm_loss)


def _stages(monkeypatch, name: str, stages: int):
    """Each stage's graph through ``lift`` and through torch.export, as split_model cut them."""
    model, batches, loss_fn = _zoo(name)
    x, y = batches[0]
    exported = export_pipeline(model, x, y, loss_fn, 2)
    seen, real = [], split.lift

    def both(root, graph, persistent):
        lifted = real(root, graph, persistent)
        args = tuple(
            torch.zeros(n.meta["val"].shape, dtype=n.meta["val"].dtype) for n in graph.find_nodes(op="placeholder")
        )
        again = export(graph_module(root, graph), args, "reference")
        seen.append((lifted and deserialize(serialize(lifted), "lifted"), deserialize(again, "again"), args))
        return lifted

    monkeypatch.setattr(split, "lift", both)
    split.split_model(exported.model, microbatch_spec(exported.input, 2), stages, [], exported.aliases)
    assert len(seen) == stages
    return seen


def _run(ep, args):
    """Outputs (flat) and the gradients of the parameters and the floating-point inputs."""
    module = ep.module()
    inputs = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    outputs = pytree.tree_leaves(module(*inputs))
    sum(o.float().sum() for o in outputs).backward()
    grads = {f"input {i}": a.grad for i, a in enumerate(inputs)}
    return outputs, grads | {k: p.grad for k, p in module.named_parameters()}


def _example(like: torch.Tensor) -> torch.Tensor:
    if like.is_floating_point():
        return torch.randn_like(like)
    return torch.ones_like(like) if like.dtype == torch.bool else torch.randint_like(like, 0, 8)


def _assert_same(lifted, again, args):
    ops = [n.target for n in lifted.graph.nodes if n.op == "call_function"]
    assert ops == [n.target for n in again.graph.nodes if n.op == "call_function"]
    kinds = [(s.kind, s.target, s.persistent) for s in lifted.graph_signature.input_specs]
    assert kinds == [(s.kind, s.target, s.persistent) for s in again.graph_signature.input_specs]
    assert len(lifted.graph_signature.output_specs) == len(again.graph_signature.output_specs)
    assert lifted.state_dict.keys() == again.state_dict.keys() and lifted.constants.keys() == again.constants.keys()
    for k, v in lifted.state_dict.items():
        assert torch.equal(v, again.state_dict[k]) and v.requires_grad == again.state_dict[k].requires_grad
    module_of = lambda ep: [split.module_path(n) for n in ep.graph.nodes if n.op == "call_function"]  # noqa: E731
    assert module_of(lifted) == module_of(again)  # what the tensor-parallel pass reads
    torch.manual_seed(0)
    args = [_example(a) for a in args]
    (out_l, grads_l), (out_a, grads_a) = _run(lifted, args), _run(again, args)
    assert all(torch.equal(p, q) for p, q in zip(out_l, out_a, strict=True))
    assert grads_l.keys() == grads_a.keys()
    assert all(torch.equal(grads_l[k], grads_a[k]) for k in grads_l if grads_a[k] is not None)


@pytest.mark.parametrize(
    "name, stages",
    [
        ("mlp", 3),
        ("transformer", 3),
        ("tied_lm", 2),
        ("fused_gate_up", 2),
        ("char_gpt", 3),
        ("hf_gpt2", 2),
        ("mistral", 3),
    ],
)
def test_a_lifted_stage_is_the_stage_torch_export_makes(monkeypatch, name, stages):
    for lifted, again, args in _stages(monkeypatch, name, stages):
        assert lifted is not None
        _assert_same(lifted, again, args)


@pytest.mark.parametrize("name", ["transformer", "hf_gpt2"])
def test_tensor_parallelism_cuts_a_lifted_stage_as_an_exported_one(monkeypatch, name):
    for lifted, again, args in _stages(monkeypatch, name, 2):
        cut_l, _ = shard_stage(serialize(lifted), 0, 2, {}, args, False, b"", None)
        cut_a, _ = shard_stage(serialize(again), 0, 2, {}, args, False, b"", None)
        assert (cut_l.params, cut_l.modules, cut_l.coverage) == (cut_a.params, cut_a.modules, cut_a.coverage)
        assert cut_l.rank_collectives == cut_a.rank_collectives


def test_a_stage_that_writes_in_place_is_exported_again(monkeypatch):
    seen = _stages(monkeypatch, "skip_net", 3)
    in_place = [again for lifted, again, _ in seen if lifted is None]
    assert len(in_place) == 1  # SkipNet's middle block adds its skip in place (out += skip)
    assert any(n.target is torch.ops.aten.add_.Tensor for n in in_place[0].graph.nodes)
    for lifted, again, args in seen:
        if lifted is not None:
            _assert_same(lifted, again, args)


_CHECK = torch.ops.aten._assert_tensor_metadata.default


def _island_run(programs: list[bytes], args: list[torch.Tensor]):
    """Each island rank's program run in a thread (an in-memory island): outputs and gradients."""
    from tests.test_tensor_parallel_pass import _ThreadIsland

    island, results = _ThreadIsland(len(programs)), [None] * len(programs)
    loaded = [deserialize(p, f"rank {t}") for t, p in enumerate(programs)]  # torch's loader is not thread-safe

    def run(t):
        with collectives.bind(island.member(t)):
            results[t] = _run(loaded[t], args)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(len(programs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(r is not None for r in results), "a rank failed"
    return results


@pytest.mark.parametrize("stage, sequence", [(0, False), (1, False), (0, True), (1, True)])
def test_a_sharded_stage_lifted_after_the_rewrite_runs_as_the_exported_one(monkeypatch, stage, sequence):
    """Tensor parallelism's rewritten rank programs (controller/compiler/parallel/tensor/stage.py)
    are lifted too, after their fake values are propagated again and the vocabulary-parallel
    embedding (stage 0) is traced into ATen operations: against the same ranks exported."""
    _, again, args = _stages(monkeypatch, "transformer", 2)[stage]
    program = serialize(again)
    cut = lambda: shard_stage(program, stage, 2, {}, args, False, b"", None, sequence)[0]  # noqa: E731
    lifted = cut()
    monkeypatch.setattr(stage_program, "lift_rewritten", lambda module, inputs: None)
    exported = cut()
    assert (lifted.params, lifted.modules, lifted.rank_collectives) == (
        exported.params,
        exported.modules,
        exported.rank_collectives,
    )
    for a, b in zip(lifted.programs, exported.programs, strict=True):
        ea, eb = deserialize(a, "lifted"), deserialize(b, "exported")
        # export also checks the dtype ahead of a ``.to`` the embedding's trace has (a check only)
        ops = lambda ep: [n.target for n in ep.graph.nodes if n.op == "call_function" and n.target != _CHECK]  # noqa: E731
        assert ops(ea) == ops(eb)
        assert [(s.kind, s.target) for s in ea.graph_signature.input_specs] == [
            (s.kind, s.target) for s in eb.graph_signature.input_specs
        ]
    torch.manual_seed(0)
    inputs = [_example(a) for a in args]
    for (out_l, grads_l), (out_e, grads_e) in zip(
        _island_run(lifted.programs, inputs), _island_run(exported.programs, inputs), strict=True
    ):
        assert all(torch.equal(p, q) for p, q in zip(out_l, out_e, strict=True))
        assert all(torch.equal(grads_l[k], grads_e[k]) for k in grads_e if grads_e[k] is not None)


def test_a_vocabulary_parallel_loss_lifted_after_the_rewrite_runs_as_the_exported_one(monkeypatch):
    """The last stage's loss, rewritten for each island rank into the vocabulary-parallel
    cross-entropy (controller/compiler/parallel/tensor/loss.py), lifted against exported."""
    model, batches, loss_fn = models.transformer(layers=2)
    x, y = batches[0]
    exported = export_pipeline(model, x, y, loss_fn, 2)
    _, again, args = _stages(monkeypatch, "transformer", 2)[1]
    target = microbatch_spec(exported.target, 2)
    cut = lambda: shard_stage(serialize(again), 1, 2, {}, args, True, exported.loss, target)[1]  # noqa: E731
    made, real = [], stage_program.lift_rewritten

    def counted(module, inputs):
        lifted = real(module, inputs)
        if len(inputs) == len(target.tensors) + 1:  # a loss program: the logits and the target
            made.append(lifted)
        return lifted

    monkeypatch.setattr(stage_program, "lift_rewritten", counted)
    lifted = cut()
    assert len(made) == 2 and None not in made  # both ranks' losses were lifted
    monkeypatch.setattr(stage_program, "lift_rewritten", lambda module, inputs: None)
    exported_losses = cut()
    assert len(lifted) == len(exported_losses) == 2
    program = deserialize(lifted[0], "loss")
    logits = next(n for n in program.graph.nodes if n.name == program.graph_signature.user_inputs[0])
    torch.manual_seed(0)
    inputs = [torch.randn(logits.meta["val"].shape), _example(torch.zeros(target.tensors[0].shape, dtype=torch.long))]
    for (out_l, grads_l), (out_e, grads_e) in zip(
        _island_run(lifted, inputs), _island_run(exported_losses, inputs), strict=True
    ):
        assert len(out_l) == len(out_e) == 1 and torch.equal(out_l[0], out_e[0])
        assert torch.equal(grads_l["input 0"], grads_e["input 0"])
