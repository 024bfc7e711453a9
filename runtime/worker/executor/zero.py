"""ZeRO stages 1, 2 and 3 (Rajbhandari et al., 2020) for one pipeline rank of a data-parallel job.

The rank's trainable parameters are laid out in flat buffers, one per unit, each padded to a
multiple of the replica count D and cut into D equal shards; replica ``d`` owns shard ``d`` of
every unit and keeps optimizer state for those alone (the units' ``mine``). The optimizers atoll
offers (SGD, Adam, AdamW) update each element from its own gradient and state only, so stepping
the shards is the same arithmetic as stepping the parameters one by one. A rank is one unit, or,
under ZeRO-3 with ``reshard_after_forward``, one unit per stage it runs.

- Stage 1: every parameter is a view of its unit's flat buffer, which every replica holds whole.
  At the end of the backward the gradients are packed into one flat buffer (each gradient then a
  view of it) and all-reduced; the optimizer steps shard ``d``, and the shards are all-gathered back.
- Stage 2: as stage 1, but the packed gradients are reduce-scattered: each replica keeps only its
  shard's average, and the full gradients are freed before the optimizer step. The reduce-scatter
  runs while the next compute does: it is waited for when the next unit's starts (one in flight at
  a time, its packed buffer counted as gradients until then) or at the step.
- Stage 3: a replica holds only its shards of the parameters. ``start_gather`` (the plan's
  GATHER_PARAMS action) all-gathers a unit's flat buffer, ``release`` (RELEASE_PARAMS) frees it,
  and a compute waits for its unit's gather (``wait_gathered``): the lowering places the gather of
  the next compute's unit before the current compute, so the two overlap. The flat buffer is one
  tensor for the job's life whose storage is resized to nothing on release and back on gather
  (as FSDP does): the parameters, and whatever views of them autograd saved for a backward, point
  into it, so a backward after a release and a new gather reads the gathered values.
  Without ``reshard_after_forward`` a rank gathers once per step and frees after its reduction: its
  stages run the step's microbatches interleaved, so the parameters are read from the first
  forward to the last backward (FSDP2 with ``reshard_after_forward=False`` under gradient
  accumulation, per pipeline rank).

Gloo has a reduce-scatter (``ProcessGroupGloo.reduce_scatter``), used as is.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from atoll.core import optim
from atoll.core.memory import storage_bytes
from atoll.core.optim import build_optimizer


class ZeroUnit:
    """One flat buffer of parameters and this replica's shard of it."""

    def __init__(self, params: list[nn.Parameter], replica: int, replicas: int, stage: int):
        self.stage = stage
        self.params = params
        self.shapes = [p.shape for p in params]
        self.replica, self.replicas = replica, replicas
        self.shard = math.ceil(sum(p.numel() for p in params) / replicas)
        self.flat = torch.zeros(self.shard * replicas, dtype=params[0].dtype, device=params[0].device)
        """The whole flat buffer; at stage 3 its storage is empty unless ``gathered``."""
        self.spans = []
        offset = 0
        for p in params:
            n = p.numel()
            self.flat[offset : offset + n].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset : offset + n].view(p.shape)
            self.spans.append((offset, n))
            offset += n
        if stage < 3:
            self.mine = nn.Parameter(self.piece(self.flat, replica))  # a view: stepping it updates the buffer
        else:
            self.mine = nn.Parameter(self.piece(self.flat, replica).clone())
        self.gathered = True
        self.pending = None
        """The handle of a gather started and not yet waited for."""
        self.reducing = None
        """Stages 2 and 3: (handle, packed gradients) of a reduce-scatter started and not yet waited for."""
        if stage == 3:
            self.release()

    def piece(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        return flat[index * self.shard : (index + 1) * self.shard]

    @property
    def parameter_bytes(self) -> int:
        return storage_bytes([self.flat, self.mine] if self.stage == 3 else [self.flat])

    @property
    def gradient_bytes(self) -> int:
        """Its gradients, its shard's average and, while a reduce-scatter is in flight, the packed buffer."""
        in_flight = [self.reducing[1]] if self.reducing is not None else []
        return storage_bytes([*(p.grad for p in self.params), self.mine.grad, *in_flight])

    def start_gather(self, group) -> int:
        """Stage 3: start gathering every replica's shard into the flat buffer; returns the bytes
        gathered (0 when held already)."""
        if self.gathered:
            return 0
        self.flat.untyped_storage().resize_(self.flat.nbytes)
        pieces = [self.piece(self.flat, d) for d in range(self.replicas)]
        self.pending = group.all_gather(pieces, self.mine.detach())
        self.gathered = True
        return self.flat.nbytes

    def wait_gathered(self, timeout_s: float) -> None:
        if self.pending is not None:
            self.pending.wait(timeout_s)
            self.pending = None  # only once it arrived: a gather that timed out may still write here

    def release(self) -> None:
        """Stage 3: free the flat buffer's storage; the parameters keep their shapes, no bytes."""
        if self.pending is not None:
            raise RuntimeError("a unit's parameters released while their gather is in flight")
        self.flat.untyped_storage().resize_(0)
        self.gathered = False

    def reduce(self, group, timeout_s: float) -> int:
        """Average the gradients across the replicas (stage 1: all of them, each replica keeping
        the whole average; stages 2 and 3: each replica receiving its shard's, the reduce-scatter
        left in flight for ``finish_reduce``); returns the bytes of the packed gradient buffer."""
        grad = torch.zeros(self.flat.shape, dtype=self.flat.dtype, device=self.flat.device)
        for p, (offset, n) in zip(self.params, self.spans):
            if p.grad is not None:  # a parameter without a gradient reduces as zeros
                grad[offset : offset + n].copy_(p.grad.reshape(-1))
            # stage 1 keeps a view of the average; the separate gradient is freed here either way
            p.grad = grad[offset : offset + n].view_as(p) if self.stage == 1 else None
        if self.stage == 1:
            group.all_reduce_sum([grad]).wait(timeout_s)
            grad.div_(self.replicas)
            own = self.piece(grad, self.replica)
        else:
            own = torch.empty(self.shard, dtype=grad.dtype, device=grad.device)
            pieces = [self.piece(grad, d) for d in range(self.replicas)]
            self.reducing = (group.reduce_scatter(own, pieces), grad)
        self.mine.grad = own
        return grad.nbytes

    def finish_reduce(self, timeout_s: float) -> None:
        """Stages 2 and 3: wait for the reduce-scatter ``reduce`` started, and average the shard."""
        if self.reducing is not None:
            handle, _ = self.reducing
            handle.wait(timeout_s)
            self.mine.grad.div_(self.replicas)
            self.reducing = None

    def share_step(self, group, timeout_s: float) -> None:
        """Below stage 3, after the optimizer stepped the shard: every replica's into the buffer."""
        own = self.piece(self.flat, self.replica).clone()  # gloo reads the input while writing outputs
        outputs = [self.piece(self.flat, d) for d in range(self.replicas)]
        group.all_gather(outputs, own).wait(timeout_s)

    def gathered_copy(self, shard: torch.Tensor, group, timeout_s: float) -> torch.Tensor:
        """Every replica's ``shard`` (of the flat layout) in one whole flat tensor."""
        flat = torch.empty(self.shard * self.replicas, dtype=shard.dtype, device=shard.device)
        group.all_gather([self.piece(flat, d) for d in range(self.replicas)], shard.detach()).wait(timeout_s)
        return flat

    def unpack(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[offset : offset + n].view(shape).clone() for (offset, n), shape in zip(self.spans, self.shapes)]

    def pack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros(self.shard * self.replicas, dtype=tensors[0].dtype, device=self.mine.device)
        for t, (offset, n) in zip(tensors, self.spans):
            flat[offset : offset + n].copy_(t.reshape(-1))
        return flat

    def load(self, params: list[torch.Tensor]) -> None:
        """This replica keeps its shard of ``params`` (whole, in the unit's order)."""
        flat = self.pack(params)
        with torch.no_grad():
            if self.stage == 3:
                self.mine.copy_(self.piece(flat, self.replica))
            else:
                self.flat.copy_(flat)  # ``mine`` is a view of it


class ZeroShard:
    """A rank's ZeRO units and the optimizer of this replica's shards. ``units``: the positions in
    ``params`` of each unit's parameters, keyed by the stages whose computes use it (default: one
    unit of all, used by every stage)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        replica: int,
        replicas: int,
        optimizer: str,
        args: dict,
        stage: int = 1,
        units: dict[int, list[int]] | None = None,
    ):
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"zero={stage} needs one parameter dtype per rank, found {sorted(map(str, dtypes))}")
        self.stage = stage
        self.params = params
        self.shapes = [p.shape for p in params]
        self.dtype = params[0].dtype
        groups = {k: v for k, v in (units or {None: list(range(len(params)))}).items() if v}
        self.positions = list(groups.values())
        self.units = [ZeroUnit([params[i] for i in at], replica, replicas, stage) for at in self.positions]
        self.unit_of = dict(zip(groups, self.units)) if units is not None else {}
        """Stage -> its unit (a stage without trainable parameters has none); empty: one unit for all."""
        self.optimizer = build_optimizer(optimizer, [u.mine for u in self.units], args)

    def unit(self, stage: int) -> ZeroUnit | None:
        return self.unit_of.get(stage) if self.unit_of else self.units[0]

    @property
    def flats(self) -> list[torch.Tensor]:
        return [u.flat for u in self.units]

    @property
    def parameter_bytes(self) -> int:
        """What this replica holds of the parameters now (stage 3: its shards, and the whole
        buffers of the units gathered)."""
        return sum(u.parameter_bytes for u in self.units)

    @property
    def gradient_bytes(self) -> int:
        return sum(u.gradient_bytes for u in self.units)

    def gather(self, group, timeout_s: float) -> int:
        """Stage 3: every unit's parameters gathered (a checkpoint's read); returns the bytes."""
        gathered = sum(u.start_gather(group) for u in self.units)
        for u in self.units:
            u.wait_gathered(timeout_s)
        return gathered

    def release(self) -> None:
        for u in self.units:
            if u.gathered:
                u.release()

    def reduce(self, group, timeout_s: float, stage: int | None = None) -> int:
        """Average the gradients over the replicas, of ``stage``'s unit (None: every unit)."""
        # one reduce-scatter in flight at a time (FSDP2's too): the previous one's buffer is freed
        # before the next is packed, and it ran while this unit's backward did
        for u in self.units:
            u.finish_reduce(timeout_s)
        if stage is None or not self.unit_of:
            return sum(u.reduce(group, timeout_s) for u in self.units)
        unit = self.unit_of.get(stage)
        return unit.reduce(group, timeout_s) if unit is not None else 0

    def step(self, group, timeout_s: float) -> None:
        """Step this replica's shards (their reductions waited for first); below stage 3, gather every
        replica's shards into the buffers."""
        for u in self.units:
            u.finish_reduce(timeout_s)
        optim.step(self.optimizer)
        if self.stage < 3:  # at stage 3 the next gather reads the stepped shards
            for u in self.units:
                u.share_step(group, timeout_s)

    def export(self, group, timeout_s: float) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
        """The whole parameters, and the optimizer state per parameter as an unsharded job keeps
        it (a checkpoint's layout, which any other layout can load). Every replica calls it:
        the shards are gathered unit by unit in the optimizer state's order, the same on each."""
        params: list[torch.Tensor | None] = [None] * len(self.params)
        state: dict[str, list[torch.Tensor | None]] = {}
        for unit, positions in zip(self.units, self.positions):
            whole = unit.flat if unit.gathered else unit.gathered_copy(unit.mine, group, timeout_s)
            for i, t in zip(positions, unit.unpack(whole)):
                params[i] = t
            for key, value in self.optimizer.state.get(unit.mine, {}).items():
                if not isinstance(value, torch.Tensor):
                    raise ValueError(f"optimizer state {key!r} is a {type(value).__name__}, not a tensor")
                # a step count is each parameter's own, all equal
                values = (
                    [value.clone() for _ in positions]
                    if value.dim() == 0
                    else unit.unpack(unit.gathered_copy(value, group, timeout_s))
                )
                slots = state.setdefault(key, [None] * len(self.params))
                for i, t in zip(positions, values):
                    slots[i] = t
        return params, state

    def load(self, params: list[torch.Tensor], state: dict[str, list[torch.Tensor]]) -> None:
        """The inverse of ``export``: this replica keeps its shards of what it is given."""
        for unit, positions in zip(self.units, self.positions):
            unit.load([params[i] for i in positions])
            self.optimizer.state[unit.mine] = {
                key: values[positions[0]].clone()
                if values[positions[0]].dim() == 0
                else unit.piece(unit.pack([values[i] for i in positions]), unit.replica).clone()
                for key, values in state.items()
            }

    def end_step(self) -> None:
        """Drop the step's gradients and, at stage 3, parameters still gathered (an evaluation or
        forward step, which reduces nothing, or a step that failed before its reduction)."""
        for u in self.units:
            u.reducing = None  # a failed step's: gloo's work holds its tensors while it runs
            u.mine.grad = None
            for p in u.params:
                p.grad = None
            # a gather still in flight (a failed step's) may write into the buffer: it stays
            if self.stage == 3 and u.gathered and u.pending is None:
                u.release()
