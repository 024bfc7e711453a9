"""Handlers of the kinds that end a training step: the data-parallel gradient average and the
optimizer step (plain, or ZeRO-1's sharded one)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from atoll.core.actions import Action, Kind
from atoll.core.memory import storage_bytes
from atoll.worker.executor.handlers import handles
from atoll.worker.executor.step import ActionFailed, StepState

if TYPE_CHECKING:
    from atoll.worker.executor.interpreter import PipelineExecutor


@handles(Kind.ALL_REDUCE_GRAD)
def all_reduce_grads(ex: PipelineExecutor, action: Action, state: StepState) -> None:
    """Average every gradient of this rank over the replicas: the same parameters in the same
    order on every replica (one plan), summed in place by one coalesced all-reduce."""
    if ex.replicas is None:
        raise ActionFailed(f"rank {ex.rank}: ALL_REDUCE_GRAD without a replica group")
    started = time.perf_counter()
    if ex.zero is not None:
        state.all_reduced_bytes += ex.zero.reduce(ex.replicas, ex.timeout_s)
    else:
        state.all_reduced_bytes += ex.buckets.finish()  # most went out during the backward
    state.waiting_s += time.perf_counter() - started


@handles(Kind.STEP)
def optimizer_step(ex: PipelineExecutor, action: Action, state: StepState) -> None:
    ex.wait(state.sends, state, "sends")
    state.sends.clear()
    if ex.optimizer is None:
        return
    if ex.zero is not None:
        started = time.perf_counter()
        ex.zero.step(ex.replicas, ex.timeout_s)
        state.waiting_s += time.perf_counter() - started
    else:
        ex.optimizer.step()
    ex.optimizer_bytes = storage_bytes(
        t for st in ex.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)
    )
