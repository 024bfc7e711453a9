"""Predicted communication: the bytes each rank moves in one step, read off its action list.

The counts follow what the executor counts as it runs (runtime/worker/executor/interpreter.py, ``data_plane_bytes``),
so a step's measured figures can be set beside these: ``sent`` and ``received`` are the tensor
bytes of its point-to-point transfers (activations, their gradients, tied-parameter gradients);
``all_reduced`` is the gradient bytes it puts into the data-parallel all-reduce (what the
collective then moves over the wire depends on gloo's algorithm and is not counted);
``island_all_reduced`` is the bytes it puts into its tensor-parallel island's collectives, read off
the sharded programs (controller/compiler/parallel/tensor/): per forward those of the stage (and of the
loss, on the last stage), per backward those of the backward, plus the forward's again where the
backward recomputes it.
"""

from __future__ import annotations

import math

import torch

from atoll.core.actions import Action
from atoll.core.dataflow import Routes


def _bytes(specs) -> int:
    return sum(t.nbytes for t in specs)


def island_bytes(shardings, rematerialize: bool) -> dict[int, tuple[int, int, int]]:
    """Stage -> (forward, backward, loss) bytes of island collectives per microbatch."""
    out = {}
    for s, sharding in enumerate(shardings):
        if sharding is not None:
            forward, loss = sharding.bytes("forward"), sharding.bytes("loss_forward")
            out[s] = (forward, sharding.bytes("backward") + (forward + loss if rematerialize else 0), loss)
    return out


def predict_rank(
    actions: list[Action],
    routes: Routes,
    rank: int,
    params: list[torch.Tensor],
    zero_shards: int,
    mode: str = "train",
    island: dict[int, tuple[int, int, int]] | None = None,
    unit_params: dict[int, list[torch.Tensor]] | None = None,
) -> dict[str, int]:
    """``params``: the rank's trainable parameters, which its replicas' collectives move; under ZeRO,
    ``unit_params``: per stage, those of its unit (ZeroLayout.unit_params)."""
    sent = received = all_reduced = island_reduced = 0
    last = routes.flow.num_stages - 1
    island = island or {}
    for a in actions:
        if not a.kind.runs_in(mode):
            continue
        s, kind = a.stage, a.kind
        forward, backward, loss = island.get(s, (0, 0, 0))
        if kind.category == "compute" and kind.direction == "forward":
            island_reduced += forward + (loss if s == last and mode != "forward" else 0)
        elif kind.category == "compute":
            island_reduced += backward
        elif kind.category == "recv":
            received += _bytes(routes.recv_f_specs(s) if kind.direction == "forward" else routes.recv_b_specs(s))
        elif kind.category == "send" and kind.direction == "forward":
            sent += sum(_bytes(e.spec.tensors) for _, e in routes.remote_out(s))
        elif kind.category == "send":
            sent += sum(_bytes(e.grad_specs) for _, e in routes.remote_in(s))
        elif kind.group == "tied":  # each holder's sum goes to every other holder
            tied = _bytes(routes.tied_recv_specs(rank))
            sent, received = sent + tied, received + tied
        elif kind.group == "replicas":
            moved = unit_params.get(s, []) if unit_params is not None else params
            elements = sum(p.numel() for p in moved)
            if zero_shards > 1:  # the flat buffer, padded to equal shards (runtime/worker/executor/zero.py)
                elements = math.ceil(elements / zero_shards) * zero_shards
            all_reduced += elements * (moved[0].element_size() if moved else 0)
    return {"sent": sent, "received": received, "all_reduced": all_reduced, "island_all_reduced": island_reduced}
