"""Tensor parallelism over a whole split model: each stage sharded over its island
(controller/compiler/parallel/tensor/), the loss made vocabulary-parallel where the logits stay
sharded, and each tied parameter cut alike by every stage holding it."""

from __future__ import annotations

from atoll.controller.compiler.compile_cache import COMPILED
from atoll.controller.compiler.parallel.tensor import shard_stage
from atoll.controller.compiler.parallel.tensor.inventory import whole_warning
from atoll.core.config import JobConfig
from atoll.core.dataflow import Dataflow, TiedParameter
from atoll.core.wire import EdgeSpec, TensorSpec
from atoll.errors import InvalidInput


def shard_stages(split, flow: Dataflow, cfg: JobConfig, mb_target: EdgeSpec, loss: bytes):
    """Every stage sharded over its island (controller/compiler/parallel/tensor/); a tied parameter must be
    cut alike by every stage holding it, and its gradient buffers are then its local piece."""
    T, last = cfg.tensor_parallel, len(split.stages) - 1
    shardings, loss_programs = [], (loss,)
    for st in split.stages:
        sharded, losses = _shard(st, _stage_input_spec(flow, st.index), cfg, st.index == last, loss, mb_target)
        shardings.append(sharded)
        warning = whole_warning(st.index, sharded)
        if warning and cfg.tensor_parallel_strict:
            raise InvalidInput(f"{warning} (tensor_parallel_strict refuses this)")
        if losses is not None:
            loss_programs = losses
    tied = []
    for t in flow.tied:
        cuts = {shardings[s].params.get(t.name) for s in t.stages}
        if len(cuts) > 1:
            raise InvalidInput(
                f"tied parameter {t.name} is cut differently by stages {list(t.stages)} ({cuts}); "
                "state a tensor_parallel_plan that keeps its modules alike"
            )
        (cut,) = cuts
        shape = list(t.spec.shape)
        if cut is not None:
            shape[cut.dim] //= T
        tied.append(TiedParameter(t.name, t.stages, TensorSpec(tuple(shape), t.spec.dtype)))
    return (
        shardings,
        (loss_programs if len(loss_programs) == T else loss_programs * T),
        Dataflow(flow.num_stages, flow.edges, tuple(tied)),
    )


def _shard(st, input_spec: EdgeSpec, cfg: JobConfig, is_last: bool, loss: bytes, mb_target: EdgeSpec):
    """``shard_stage`` for one split stage, or its kept result for the same program (and loss)
    sharded the same way (controller/compiler/compile_cache.py)."""
    plan = dict(cfg.tensor_parallel_plan)
    return COMPILED.get(
        "shard",
        (st.program, loss) if is_last else (st.program,),
        (
            st.index,
            cfg.tensor_parallel,
            repr(tuple(plan.items())),
            input_spec.tensors,
            is_last,
            mb_target if is_last else None,
            cfg.sequence_parallel,
        ),
        lambda: shard_stage(
            st.program,
            st.index,
            cfg.tensor_parallel,
            plan,
            [t.empty("cpu").zero_() for t in input_spec.tensors],
            is_last,
            loss,
            mb_target,
            cfg.sequence_parallel,
        ),
        _held_bytes,
    )


def _held_bytes(result) -> int:
    sharded, losses = result
    return sum(len(p) for p in sharded.programs) + sum(len(p) for p in losses or ())


def _stage_input_spec(flow: Dataflow, stage: int) -> EdgeSpec:
    """A stage's inputs by position, from the edges into it."""
    specs: dict[int, TensorSpec] = {}
    for _, e in flow.incoming(stage):
        for j, t in zip(e.dst_indices, e.spec.tensors):
            specs[j] = t
    return EdgeSpec(f"stage {stage} input", tuple(specs[j] for j in sorted(specs)))
