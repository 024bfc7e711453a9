"""The controller's compile cache (controller/compiler/compile_cache.py): the same exported model
cut (or sharded) the same way is reused, anything else is computed again, and the byte budget
holds."""

import pytest
import torch

from atoll.client.export import export_pipeline
from atoll.controller.compiler.compile_cache import COMPILED, CompileCache
from atoll.controller.compiler.passes import microbatch_spec
from atoll.controller.compiler.split import split_model
from atoll.core.graphs import deserialize
from atoll.errors import InvalidInput
from tests import models


def _exported(seed: int = 0):
    model, batches, loss_fn = models.mlp(seed)
    x, y = batches[0]
    return export_pipeline(model, x, y, loss_fn, 2)


def _split(cache: CompileCache, exported, stages: int):
    return cache.get(
        "split",
        (exported.model,),
        (exported.input, stages),
        lambda: _fresh(exported, stages),
        lambda split: sum(len(s.program) for s in split.stages),
    )


def _fresh(exported, stages: int):
    return split_model(exported.model, microbatch_spec(exported.input, 2), stages, [], {})


def test_the_same_model_exported_again_reuses_its_split():
    cache = CompileCache()
    first = _split(cache, _exported(), 2)
    again = _exported()  # a second export of an identical model: the same bytes
    second = _split(cache, again, 2)
    assert (cache.hits["split"], cache.misses["split"]) == (1, 1)
    fresh = _fresh(again, 2)
    _assert_same_split(first, fresh)
    _assert_same_split(second, fresh)


def _assert_same_split(a, b):
    """The same stages and dataflow; the programs the same graph and weights (their archives differ
    in torch's provenance records, which name graphs by object id)."""
    assert a.dataflow == b.dataflow
    assert [(s.index, s.modules, s.start) for s in a.stages] == [(s.index, s.modules, s.start) for s in b.stages]
    for x, y in zip(a.stages, b.stages):
        ex, ey = deserialize(x.program, "a"), deserialize(y.program, "b")
        assert ex.graph_module.code == ey.graph_module.code
        assert ex.state_dict.keys() == ey.state_dict.keys()
        assert all(torch.equal(ex.state_dict[k], ey.state_dict[k]) for k in ex.state_dict)


def test_other_weights_or_another_cut_split_again():
    cache = CompileCache()
    _split(cache, _exported(0), 2)
    _split(cache, _exported(1), 2)  # other weights
    _split(cache, _exported(0), 3)  # another number of stages
    assert (cache.hits["split"], cache.misses["split"]) == (0, 3)
    _split(cache, _exported(1), 2)
    assert cache.hits["split"] == 1


def test_the_budget_keeps_the_most_recent_and_never_a_larger_model():
    exported = [_exported(seed) for seed in range(3)]
    size = sum(len(s.program) for s in _fresh(exported[0], 2).stages)
    cache = CompileCache(budget_bytes=2 * size + size // 2)  # room for two of these
    for e in exported:
        _split(cache, e, 2)
    _split(cache, exported[2], 2)
    _split(cache, exported[1], 2)
    assert cache.hits["split"] == 2
    _split(cache, exported[0], 2)  # the least recently used went first
    assert (cache.hits["split"], cache.misses["split"]) == (2, 4)

    tiny = CompileCache(budget_bytes=size // 2)
    _split(tiny, exported[0], 2)
    _split(tiny, exported[0], 2)
    assert (tiny.hits["split"], tiny.misses["split"]) == (0, 2)  # larger than the budget: never kept (nor hashed)


def test_a_failed_split_is_not_kept():
    cache = CompileCache()
    exported = _exported()
    with pytest.raises(InvalidInput, match="cannot split"):
        _split(cache, exported, 1000)
    with pytest.raises(InvalidInput, match="cannot split"):
        _split(cache, exported, 1000)
    assert (cache.hits["split"], cache.misses["split"]) == (0, 2)


def _counts():
    return {kind: (COMPILED.hits[kind], COMPILED.misses[kind]) for kind in ("split", "shard")}


def _since(before):
    return {kind: (h - before[kind][0], m - before[kind][1]) for kind, (h, m) in _counts().items()}


def test_the_compiler_splits_a_resubmitted_model_once():
    model, batches, loss_fn = models.mlp(7)
    x, y = batches[0]
    before = _counts()
    one = models.compile_locally(model, x, y, loss_fn, stages=2, microbatches=2, schedule="gpipe")
    two = models.compile_locally(model, x, y, loss_fn, stages=2, microbatches=2, schedule="1f1b")
    assert _since(before) == {"split": (1, 1), "shard": (0, 0)}
    assert [s.info for s in one.stages] == [s.info for s in two.stages]  # programs, specs, costs
    assert (one.topology.schedule, two.topology.schedule) == ("gpipe", "1f1b")


def test_the_compiler_shards_a_resubmitted_model_once_per_layout():
    model, batches, loss_fn = models.transformer(3, layers=2)
    x, y = batches[0]
    before = _counts()
    layout = dict(stages=2, tensor_parallel=2, microbatches=2)
    sgd = models.compile_locally(model, x, y, loss_fn, **layout, optimizer="sgd")
    adamw = models.compile_locally(model, x, y, loss_fn, **layout, optimizer="adamw")
    assert _since(before) == {"split": (1, 1), "shard": (2, 2)}  # the optimizer is not the pass's business
    assert [s.programs for s in sgd.stages] == [s.programs for s in adamw.stages]
    assert sgd.loss_programs == adamw.loss_programs and sgd.cuts == adamw.cuts
    models.compile_locally(model, x, y, loss_fn, **layout, sequence_parallel=True)
    assert _since(before) == {"split": (2, 1), "shard": (2, 4)}  # another way to shard
