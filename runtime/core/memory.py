"""Byte accounting of what a worker holds, by category.

The same counter runs on real tensors (the worker's measurement) and on fake tensors (the
compiler's prediction), so the two differ only where real execution differs from the plan.
Stashed activations are the storages autograd saves for backward, found with saved-tensor
hooks; parameters and receive buffers are excluded there and counted in their own category.
A worker counts a stage's first run in each mode and reuses that figure
(atoll.worker.executor.compute._counted).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


def _storage(t: torch.Tensor):
    # A view resolves to its base (``_base`` is always the root, never another view): a fake
    # tensor's view, say ``weight.t()`` saved by a linear layer, has a storage object of its own.
    base = t._base
    return (t if base is None else base).untyped_storage()


def storage_key(t: torch.Tensor) -> int:
    """Identity of the memory behind ``t``."""
    return _storage(t)._cdata


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = _storage(t)
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


class GradientBytes:
    """``storage_bytes`` of a rank's gradients, remembered by the gradient tensors' identities.

    A worker counts its gradients after every action; between steps they are the same tensors
    (autograd accumulates in place) or none, and a gradient always has its parameter's shape, so
    the few sets seen are remembered instead of looking up each tensor's storage every time (about
    a millisecond a step for a 72-parameter stage on this machine). Not for tensors whose storage
    is resized in place (ZeRO's gathered buffers)."""

    def __init__(self):
        self._seen: dict[tuple[int, ...], int] = {}

    def __call__(self, grads: list[torch.Tensor | None]) -> int:
        key = tuple(0 if g is None else id(g) for g in grads)
        n = self._seen.get(key)
        if n is None:
            if len(self._seen) >= 4:  # ids of freed tensors: forget them now and then
                self._seen.clear()
            n = self._seen[key] = storage_bytes(grads)
        return n


class SavedTensors:
    """Context manager: records the storages autograd saves while it is active."""

    def __init__(self, exclude: set[int], also_exclude: set[int] = frozenset()):
        """``exclude``: storages counted elsewhere (shared, not copied); ``also_exclude``: a few
        more for this count alone."""
        self.exclude = exclude
        self.also_exclude = also_exclude
        self.storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._count(t)
        # detach: holding ``t`` itself would tie saved outputs to their grad_fn in a cycle
        return t.detach()

    def _count(self, t: torch.Tensor) -> None:
        storage = _storage(t)
        key = storage._cdata
        if key not in self.exclude and key not in self.also_exclude:
            self.storages[key] = storage.nbytes()

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors the executor holds on to for backward (stage outputs, inputs)."""
        for t in tensors:
            self._count(t)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(slots=True)
class MemorySnapshot:
    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    buffers: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.buffers

    def as_dict(self) -> dict[str, int]:
        # not dataclasses.asdict, which deep-copies field by field: 5.5 us against 0.3 here, every step
        return {f: getattr(self, f) for f in self.__slots__} | {"total": self.total}


class PeakMeter:
    """Tracks the peak total over a step, keeping the breakdown at the peak."""

    def __init__(self):
        self.peak = MemorySnapshot()
        self.peak_stashed_microbatches = 0
        self.at_step: MemorySnapshot | None = None
        """What was held at the optimizer step: the model state as the ZeRO paper counts it
        (parameters, gradients, optimizer state), no activation left."""

    def observe(self, snap: MemorySnapshot, stashed_microbatches: int, step: bool = False) -> None:
        if step:
            self.at_step = snap
        if snap.total > self.peak.total:
            self.peak = snap
        self.peak_stashed_microbatches = max(self.peak_stashed_microbatches, stashed_microbatches)
