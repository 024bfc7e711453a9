"""Collectives of a tensor-parallel island, as torch custom ops that stage graphs call.

The compiler (controller/compiler/parallel/tensor/) writes these ops into each rank's stage graph where
Megatron-LM puts its conjugate operators: ``island_all_reduce`` is Megatron's *g* (sum the
partial outputs of a row-parallel layer; its gradient passes through unchanged) and
``island_copy`` is *f* (the input of a column-parallel layer; its gradient is summed over the
island). Being custom ops, they survive ``torch.export`` as single nodes, so a worker runs the
same exported program format as for any stage; the executor binds the island's group around each
forward and backward (``bind``), and counts every byte put into a collective.

With sequence parallelism (Korthikanti et al. 2022) the regions between them run on a slice of the
sequence (dimension ``dim``): ``island_reduce_scatter`` replaces g (its backward all-gathers),
``island_gather`` replaces f (forward all-gather; backward reduce-scatter, as the layers after it
give each rank a partial gradient) and ``island_gather_whole`` hands a whole value to code that
runs alike on every rank (its backward keeps this rank's slice); ``island_scatter`` takes this
rank's slice of a whole value (backward: all-gather). gloo has no reduce-scatter: it is an
all-reduce of the whole tensor, then the slice.

The vocabulary-parallel embedding and cross-entropy are plain functions over these ops that the
compiler inserts into the graph; export traces them into aten ops plus the island collectives.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Protocol

import torch
from torch.library import custom_op


class IslandGroup(Protocol):
    """What the ops need of the island (runtime/worker/transports/gloo.py's GlooTransport): an in-place
    ``all_reduce`` ("sum" or "max") and an ``all_gather_into``, each waited for with a deadline."""

    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor, op: str) -> None: ...

    def all_gather_into(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> None: ...


class _Binding(threading.local):
    group: IslandGroup | None = None


_binding = _Binding()
# group -> bytes put into its collectives since the last take; held weakly, by the group itself:
# keyed by id(), bytes a dead group never took went to a later group given the same id (a CI run
# counted 147456 bytes too many for a 4-rank island)
_counted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_counted_lock = threading.Lock()


@contextlib.contextmanager
def bind(group: IslandGroup | None):
    """Run a stage's forward or backward on this thread with ``group`` as its island."""
    previous, _binding.group = _binding.group, group
    try:
        yield
    finally:
        _binding.group = previous


def take_counted_bytes(group: IslandGroup) -> int:
    """Bytes put into ``group``'s collectives since the last call (then reset), from any thread:
    autograd runs a CUDA backward on a device thread of its own."""
    with _counted_lock:
        return _counted.pop(group, 0)


def _count(group: IslandGroup, nbytes: int) -> None:
    with _counted_lock:
        _counted[group] = _counted.get(group, 0) + nbytes


def _group() -> IslandGroup:
    group = _binding.group
    if group is None:
        raise RuntimeError("an island collective ran outside a tensor-parallel stage (no island group bound)")
    return group


def _keep(ctx, inputs, output):
    """Setup of every backward that communicates: the island bound while the forward ran (None
    in the controller's fake-tensor analysis, which binds none and runs no collective)."""
    ctx.group = _binding.group
    ctx.dim, ctx.ranks = (inputs[1], inputs[2]) if len(inputs) == 3 else (None, None)


def _on_forward_island(backward):
    """``backward`` run with the island its forward saw bound: on CPU autograd runs a backward on
    the thread that called it, which has it bound already; for CUDA tensors on a device thread."""

    def run(ctx, grad):
        if ctx.group is None or ctx.group is _binding.group:
            return backward(ctx, grad)
        with bind(ctx.group):
            return backward(ctx, grad)

    return run


def _run(x: torch.Tensor, op: str) -> torch.Tensor:
    out = x.contiguous().clone()
    group = _group()
    group.all_reduce(out, op)
    _count(group, out.nbytes)
    return out


def _gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    group = _group()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.world_size)]
    group.all_gather_into(parts, x)
    _count(group, x.nbytes)
    return torch.cat(parts, dim)


def _slice(x: torch.Tensor, dim: int) -> torch.Tensor:
    group = _group()
    return x.chunk(group.world_size, dim)[group.rank].contiguous().clone()


@custom_op("atoll::island_all_reduce", mutates_args=())
def island_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the island (Megatron's g); backward: the gradient as it is."""
    return _run(x, "sum")


island_all_reduce.register_fake(torch.empty_like)


island_all_reduce.register_autograd(lambda ctx, grad: grad)


@custom_op("atoll::island_copy", mutates_args=())
def island_copy(x: torch.Tensor) -> torch.Tensor:
    """The input of column-parallel layers (Megatron's f): forward a copy; backward: the
    gradient summed over the island (each rank's holds only its shard's contribution)."""
    return x.clone()


island_copy.register_fake(torch.empty_like)


island_copy.register_autograd(_on_forward_island(lambda ctx, grad: island_all_reduce(grad)), setup_context=_keep)


@custom_op("atoll::island_max", mutates_args=())
def island_max(x: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum over the island; not differentiable (used on detached values)."""
    return _run(x, "max")


island_max.register_fake(torch.empty_like)


def _resized(x: torch.Tensor, dim: int, factor: float) -> torch.Tensor:
    out = list(x.shape)
    out[dim] = int(out[dim] * factor)
    return x.new_empty(out)


@custom_op("atoll::island_reduce_scatter", mutates_args=())
def island_reduce_scatter(x: torch.Tensor, dim: int, ranks: int) -> torch.Tensor:
    """Sum over the island, keep this rank's slice along ``dim``; backward: all-gather."""
    return _slice(_run(x, "sum"), dim)


@custom_op("atoll::island_gather", mutates_args=())
def island_gather(x: torch.Tensor, dim: int, ranks: int) -> torch.Tensor:
    """All-gather along ``dim`` into layers that give each rank a partial gradient (Megatron's f
    under sequence parallelism); backward: reduce-scatter."""
    return _gather(x, dim)


@custom_op("atoll::island_gather_whole", mutates_args=())
def island_gather_whole(x: torch.Tensor, dim: int, ranks: int) -> torch.Tensor:
    """All-gather along ``dim`` into code every rank runs alike; backward: this rank's slice."""
    return _gather(x, dim)


@custom_op("atoll::island_scatter", mutates_args=())
def island_scatter(x: torch.Tensor, dim: int, ranks: int) -> torch.Tensor:
    """This rank's slice along ``dim`` of a whole value (no communication); backward: all-gather."""
    return _slice(x, dim)


island_reduce_scatter.register_fake(lambda x, dim, ranks: _resized(x, dim, 1 / ranks))
island_scatter.register_fake(lambda x, dim, ranks: _resized(x, dim, 1 / ranks))
island_gather.register_fake(lambda x, dim, ranks: _resized(x, dim, ranks))
island_gather_whole.register_fake(lambda x, dim, ranks: _resized(x, dim, ranks))
island_reduce_scatter.register_autograd(
    _on_forward_island(lambda ctx, grad: (island_gather_whole(grad, ctx.dim, ctx.ranks), None, None)),
    setup_context=_keep,
)
island_gather.register_autograd(
    _on_forward_island(lambda ctx, grad: (island_reduce_scatter(grad, ctx.dim, ctx.ranks), None, None)),
    setup_context=_keep,
)
island_gather_whole.register_autograd(
    _on_forward_island(lambda ctx, grad: (island_scatter(grad, ctx.dim, ctx.ranks), None, None)), setup_context=_keep
)
island_scatter.register_autograd(
    _on_forward_island(lambda ctx, grad: (island_gather_whole(grad, ctx.dim, ctx.ranks), None, None)),
    setup_context=_keep,
)


def vocab_parallel_embedding(weight: torch.Tensor, ids: torch.Tensor, start: int, reduce: bool = True):
    """Embedding of ``ids`` where this rank holds vocabulary rows ``start .. start + len(weight)``:
    ids of other ranks' rows give zeros here, and the island's sum is the full embedding (summed
    here, or by the caller when ``reduce`` is False: a reduce-scatter under sequence parallelism)."""
    local = ids - start
    mine = (local >= 0) & (local < weight.shape[0])
    rows = torch.nn.functional.embedding(torch.where(mine, local, torch.zeros_like(local)), weight)
    rows = rows * mine.unsqueeze(-1).to(rows.dtype)
    return island_all_reduce(rows) if reduce else rows


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, start: int, ignore_index: int, reduction: int
) -> torch.Tensor:
    """Cross-entropy of (N, V/T) logit shards against (N,) targets in the full vocabulary
    (Megatron-LM's vocab-parallel cross-entropy): the row maximum, the sum of exponentials and
    the target's logit are each reduced over the island; no rank ever holds a full row.
    ``reduction``: 1 mean over non-ignored targets, 2 sum (aten's codes)."""
    row_max = island_max(logits.detach().amax(dim=-1))
    shifted = logits - row_max.unsqueeze(-1)
    sum_exp = island_all_reduce(shifted.exp().sum(dim=-1))
    local = target - start
    mine = (local >= 0) & (local < logits.shape[-1])
    picked = shifted.gather(-1, torch.where(mine, local, torch.zeros_like(local)).unsqueeze(-1)).squeeze(-1)
    picked = island_all_reduce(picked * mine.to(picked.dtype))
    valid = (target != ignore_index).to(logits.dtype)
    losses = (sum_exp.log() - picked) * valid
    return losses.sum() / valid.sum() if reduction == 1 else losses.sum()
