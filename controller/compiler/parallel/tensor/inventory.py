"""What tensor parallelism cut in a stage, and what that costs: the roles of its modules (checked
against the user's tensor_parallel_plan), its sharded parameters, and the island collectives each
rank's program runs, read off the exported programs themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atoll.controller.compiler.parallel.graph_ops import ADDMM, LINEAR
from atoll.controller.compiler.parallel.tensor.propagate import SDPA, Decisions, Shard
from atoll.controller.compiler.split import flops_per_node, module_path
from atoll.core.graphs import deserialize
from atoll.core.shards import ParamShard
from atoll.errors import InvalidInput

ROLES = ("colwise", "rowwise", "vocab_embedding", "replicate", "rowwise_if_sharded")
"""What a plan may state: "rowwise_if_sharded" cuts a layer row-parallel where its input arrives
sharded and keeps it whole otherwise, never column-parallel (a LoRA adapter's A: cutting its few
output features would make B row-parallel, its partial sums meeting the base layer's column shards)."""
_ops = torch.ops.atoll
# per island op: the (direction, "in"/"out") of each collective it runs, as the bytes of its input or
# output tensor; e.g. a reduce-scatter all-reduces its whole input forward and all-gathers its
# output's gradient backward (atoll.core.collectives counts the same tensors as it runs)
COLLECTIVE_OPS = {
    _ops.island_all_reduce.default: (("forward", "in", "all_reduce_sum"),),
    _ops.island_max.default: (("forward", "in", "all_reduce_max"),),
    _ops.island_copy.default: (("backward", "in", "all_reduce_sum"),),
    _ops.island_reduce_scatter.default: (("forward", "in", "reduce_scatter"), ("backward", "out", "all_gather")),
    _ops.island_gather.default: (("forward", "in", "all_gather"), ("backward", "out", "reduce_scatter")),
    _ops.island_gather_whole.default: (("forward", "in", "all_gather"),),
    _ops.island_scatter.default: (("backward", "out", "all_gather"),),
}


@dataclass(frozen=True, slots=True)
class ShardedStage:
    programs: tuple[bytes, ...]
    """Per island rank: the stage's exported program with that rank's shards."""
    params: dict[str, ParamShard]
    """The stage's sharded parameters (the rest are whole on every rank)."""
    modules: dict[str, str]
    """Module -> its role: colwise, rowwise, vocab_embedding, vocab_head, or why it stays replicated."""
    output_dims: dict[int, int]
    """Stage output position -> the dimension it is sharded along (the last stage's logits)."""
    coverage: dict[str, float]
    """The share of the stage's parameters ("parameters") and of its matrix products' forward FLOPs
    ("forward_flops": torch's FLOP count of each node, as the split's cost model) divided over the island."""
    whole: dict[str, str]
    """The linear layers left whole on every rank, each with why (the plan's "replicate" included)."""
    rank_collectives: tuple[dict[str, list[dict]], ...]
    """Per island rank, read off its own program: "forward", "backward" (and "loss_forward" on the
    last stage), each island all-reduce one microbatch runs, in order, with its shape and bytes.
    The simulator checks that the island's ranks meet at each in the same order."""

    @property
    def collectives(self) -> dict[str, list[dict]]:
        return self.rank_collectives[0]

    def bytes(self, direction: str) -> int:
        return sum(c["bytes"] for c in self.collectives.get(direction, ()))


def check_roles(plan: dict) -> None:
    """Before anything is decided: every role the plan states is one the pass knows."""
    unknown = [m for m, role in plan.items() if role not in ROLES]
    if unknown:
        raise InvalidInput(f"tensor_parallel_plan: unknown role for {unknown} (known: {', '.join(ROLES)})")


def check_decisions(gm, d: Decisions, plan: dict, index: int, ranks: int) -> None:
    """Once decided: the stage has something to cut, and every module the plan names for a role
    found it (else the plan names the reason it stays replicated)."""
    if not d.column and not d.embedding:
        reasons_shown = (
            "; ".join(f"{m}: {r}" for m, r in d.replicated.items()) or "it has no linear layers or embeddings"
        )
        raise InvalidInput(
            f"stage {index} is too small to shard over tensor_parallel={ranks}: nothing in it can be split "
            f"({reasons_shown})"
        )
    here = {module_path(n) for n in gm.graph.nodes}
    found = {"colwise": d.column, "rowwise": d.row, "vocab_embedding": d.embedding}
    for module, role in plan.items():
        if module in here and role in found and module not in {module_path(n) for n in found[role]}:
            why = d.replicated.get(module, "the compiler finds another role for it")
            raise InvalidInput(f"tensor_parallel_plan says {module!r} is {role}, but it cannot be: {why}")


def module_roles(d: Decisions) -> dict[str, str]:
    """Module -> the role it got, or why it stays replicated (ShardedStage.modules)."""
    roles = dict(d.replicated)
    roles.update({module_path(n) or n.name: "colwise" for n in d.column})
    roles.update({module_path(n) or n.name: "vocab_head" for n in d.output_origins})
    roles.update({module_path(n) or n.name: "rowwise" for n in d.row})
    roles.update({module_path(n) or n.name: "vocab_embedding" for n in d.embedding})
    return roles


def coverage(gm, d: Decisions, inputs: list) -> dict[str, float]:
    """ShardedStage.coverage; ``inputs``: example stage inputs."""
    params = dict(gm.named_parameters())
    total = sum(p.numel() for p in params.values())
    cut = sum(params[name].numel() for name in d.params if name in params)
    flops = divided = 0
    for node, f in flops_per_node(gm, lambda: inputs).items():
        flops += f
        if node in d.column or node in d.row or (node.target is SDPA and isinstance(d.place.get(node), Shard)):
            divided += f
    return {
        "parameters": round(cut / total, 4) if total else 0.0,
        "forward_flops": round(divided / flops, 4) if flops else 0.0,
    }


def whole_linears(gm, d: Decisions) -> dict[str, str]:
    """ShardedStage.whole: every linear layer neither column- nor row-parallel, with its reason."""
    out = {}
    for node in gm.graph.nodes:
        if node.target in (LINEAR, ADDMM) and node not in d.column and node not in d.row:
            name = module_path(node) or node.name
            out[name] = d.replicated.get(name) or "its input or weight is not one the pass can cut"
    return out


def whole_warning(index: int, stage: ShardedStage) -> str | None:
    """What a stage leaves undivided, for the user: None when every linear layer is cut (or is
    whole because the plan says "replicate")."""
    whole = {m: why for m, why in stage.whole.items() if why != "stated by the plan"}
    if not whole:
        return None
    share = stage.coverage
    return (
        f"tensor parallelism leaves {len(whole)} linear layer(s) of stage {index} whole on every rank "
        f"({'; '.join(f'{m}: {why}' for m, why in whole.items())}): "
        f"{1 - share['parameters']:.0%} of the stage's parameters and {1 - share['forward_flops']:.0%} of its "
        f"matrix products' forward FLOPs are not divided"
    )


def program_collectives(data: bytes) -> dict[str, list[dict]]:
    """The island collectives an exported program runs per microbatch, forward and backward, in order."""
    out = {"forward": [], "backward": []}
    for node in deserialize(data, "sharded program").graph.nodes:
        for direction, side, op in COLLECTIVE_OPS.get(node.target, ()):
            v = node.meta["val"] if side == "out" else node.args[0].meta["val"]
            out[direction].append({"op": op, "shape": list(v.shape), "bytes": v.numel() * v.element_size()})
    out["backward"].reverse()  # backward runs them last to first
    return out


def rank_collectives(programs, loss_programs) -> tuple[dict[str, list[dict]], ...]:
    """Per island rank: its stage program's collectives, and its loss program's as "loss_forward"."""
    per_rank = []
    for t, program in enumerate(programs):
        found = program_collectives(program)
        if loss_programs:
            found["loss_forward"] = program_collectives(loss_programs[t])["forward"]
        per_rank.append(found)
    return tuple(per_rank)
