"""The vocabulary-parallel loss: whether a stage's vocabulary-sharded logits (a column-parallel LM
head) can enter the loss program sharded, and that loss program exported for each island rank.

The loss program runs on the last stage's ranks. Its cross-entropy, fed logits sharded along the
vocabulary, becomes atoll.core.collectives.vocab_parallel_cross_entropy (max, sum of exponentials
and the target's logit, each reduced over the island), so the whole logits never exist on one rank.
Anything else about the loss sends the LM head back to replicated, and the stage is decided again.
"""

from __future__ import annotations

import torch
from torch import fx

from atoll.controller.compiler.parallel.graph_ops import tensor_value as _val
from atoll.controller.compiler.parallel.tensor.propagate import Conflict, Decisions, Pass, Shard, decide, load_graph
from atoll.controller.compiler.parallel.tensor.rewrite import rewrite
from atoll.controller.compiler.stage_program import rewritten_program


def _loss_decisions(lgm: fx.GraphModule, d: Decisions, ranks: int, target_spec) -> Decisions:
    """The loss program's decisions with the stage's logits arriving sharded; raises Conflict (naming
    the LM head) when they cannot enter it so."""
    holders = [n for n in lgm.graph.nodes if n.op == "placeholder"]
    if not (len(holders) == len(d.output_dims) + len(target_spec.tensors) == 2):
        raise Conflict(d.output_origins, "the loss takes more than logits and a target")
    initial = {holders[0]: Shard(d.output_dims[0], d.output_origins)}
    ld = Pass(lgm, ranks, set(), {}, initial, False).run()
    if not ld.loss:
        raise Conflict(d.output_origins, "the loss takes the logits whole")
    return ld


def decide_with_loss(
    gm: fx.GraphModule, ranks: int, plan: dict, is_last: bool, loss: bytes, target_spec
) -> tuple[Decisions, fx.GraphModule | None, Decisions | None]:
    """The stage's decisions and, when its logits leave it vocabulary-sharded, the loss program with
    its own decisions (else None, None). Only the last stage may send shards out (``is_last``)."""
    excluded, reasons = set(), {}
    while True:
        d = decide(gm, ranks, plan, {}, is_last, excluded, reasons)
        if not d.output_dims:
            return d, None, None
        lgm = load_graph(loss, "loss program")
        try:
            return d, lgm, _loss_decisions(lgm, d, ranks, target_spec)
        except Conflict as c:
            reason = c.reason
        for o in d.output_origins:
            reasons[o] = f"its vocabulary shards cannot enter the loss: {reason}"
        excluded |= d.output_origins


def export_loss(lgm: fx.GraphModule, ld: Decisions, d: Decisions, rank: int, ranks: int, target_spec) -> bytes:
    """Island rank ``rank``'s loss program, exported at its shard of the logits and the whole target."""
    logits = _val(next(n for n in lgm.graph.nodes if n.op == "placeholder"))
    shape = list(logits.shape)
    shape[d.output_dims[0]] //= ranks
    args = (torch.zeros(shape, dtype=logits.dtype), *(s.empty("cpu").zero_() for s in target_spec.tensors))
    failure = f"the loss (rank {rank}) could not be exported after sharding"
    return rewritten_program(rewrite(lgm, ld, rank, ranks), args, failure)
