"""``shard_stage``: one pipeline stage through the whole tensor-parallel pass, from its exported
program to one exported program per island rank (and, on the last stage, per-rank loss programs).
"""

from __future__ import annotations

from atoll.controller.compiler.parallel.sequence import plan_sequence
from atoll.controller.compiler.parallel.tensor.inventory import (
    ShardedStage,
    check_decisions,
    check_roles,
    coverage,
    module_roles,
    rank_collectives,
    whole_linears,
)
from atoll.controller.compiler.parallel.tensor.loss import decide_with_loss, export_loss
from atoll.controller.compiler.parallel.tensor.propagate import Shard, load_graph
from atoll.controller.compiler.parallel.tensor.rewrite import rewrite
from atoll.controller.compiler.stage_program import rewritten_program


def shard_stage(
    data: bytes,
    index: int,
    ranks: int,
    plan: dict,
    inputs: list,
    is_last: bool,
    loss: bytes,
    target_spec,
    sequence_parallel: bool = False,
) -> tuple[ShardedStage, tuple[bytes, ...] | None]:
    """Shard stage ``index`` over ``ranks`` (and its token-wise code along the sequence, with
    ``sequence_parallel``); for the last stage, also its loss (per-rank loss programs, or None
    when the logits stay whole). ``inputs``: example input tensors."""
    gm = load_graph(data, f"stage {index} program")
    check_roles(plan)
    d, lgm, loss_decisions = decide_with_loss(gm, ranks, plan, is_last, loss, target_spec)
    check_decisions(gm, d, plan, index, ranks)
    sp = None
    if sequence_parallel:
        sharded = {n for n, s in d.place.items() if isinstance(s, (Shard, list))}
        sp = plan_sequence(gm, ranks, set(d.column), d.row, d.embedding, sharded)
    programs, loss_out = [], []
    for t in range(ranks):
        local_inputs = tuple(inputs)
        module = rewrite(gm, d, t, ranks, sp)
        failure = f"stage {index} (rank {t} of its island) could not be exported after sharding"
        programs.append(rewritten_program(module, local_inputs, failure))
        if loss_decisions is not None:
            loss_out.append(export_loss(lgm, loss_decisions, d, t, ranks, target_spec))
    stage = ShardedStage(
        programs=tuple(programs),
        params={name: shard for name, (shard, _) in d.params.items()},
        modules=module_roles(d),
        output_dims=dict(d.output_dims),
        coverage=coverage(gm, d, inputs),
        whole=whole_linears(gm, d),
        rank_collectives=rank_collectives(programs, loss_out),
    )
    return stage, tuple(loss_out) if loss_out else None
