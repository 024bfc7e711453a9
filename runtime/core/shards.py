"""How a tensor-parallel parameter is cut over an island: the compiler decides it
(controller/compiler/parallel/tensor/), the controller joins shards back (state_dict), workers cut and
join them when a checkpoint moves between layouts (atoll.core.checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atoll._rpc import atoll_pb2 as pb


@dataclass(frozen=True, slots=True)
class ParamShard:
    """How a parameter is cut: along ``dim``, each of the ``blocks`` (sizes along ``dim``, e.g. the
    q, k and v parts of a fused projection) cut into T equal pieces, rank t taking piece t of each."""

    dim: int
    blocks: tuple[int, ...]

    def local(self, full: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
        parts, start = [], 0
        for size in self.blocks:
            piece = size // ranks
            parts.append(full.narrow(self.dim, start + rank * piece, piece))
            start += size
        return torch.cat(parts, self.dim).contiguous()

    def join(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's piece, in rank order (the inverse of ``local``)."""
        pieces = [list(torch.split(s, [b // len(shards) for b in self.blocks], self.dim)) for s in shards]
        return torch.cat([pieces[t][i] for i in range(len(self.blocks)) for t in range(len(shards))], self.dim)

    def to_json(self) -> dict:
        return {"dim": self.dim, "blocks": list(self.blocks)}

    @staticmethod
    def from_json(data: dict) -> ParamShard:
        return ParamShard(int(data["dim"]), tuple(int(b) for b in data["blocks"]))

    def to_pb(self, name: str) -> pb.ParamCut:
        return pb.ParamCut(name=name, dim=self.dim, blocks=self.blocks)

    @staticmethod
    def from_pb(msg: pb.ParamCut) -> ParamShard:
        if msg.dim < 0 or not msg.blocks or any(b < 1 for b in msg.blocks):
            raise ValueError(f"malformed cut of {msg.name}: dim {msg.dim}, blocks {list(msg.blocks)}")
        return ParamShard(msg.dim, tuple(msg.blocks))
