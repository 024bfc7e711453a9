"""Handlers of the data-parallel replicas' collectives and of the optimizer step: ZeRO-3's gather
of the parameters (first in a step), the gradient average and the step (plain, or ZeRO's sharded
one; runtime/worker/executor/zero.py)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from atoll.core.actions import Action, Kind
from atoll.core.memory import storage_bytes, storage_key
from atoll.worker.executor.handlers import handles
from atoll.worker.executor.step import ActionFailed, StepState

if TYPE_CHECKING:
    from atoll.worker.executor.interpreter import PipelineExecutor


@handles(Kind.GATHER_PARAMS)
def gather_params(ex: PipelineExecutor, action: Action, state: StepState) -> None:
    """ZeRO-3: the whole parameters from the replicas' shards, held until the gradients are reduced."""
    if ex.zero is None or ex.replicas is None:
        raise ActionFailed(f"rank {ex.rank}: GATHER_PARAMS without ZeRO-3 replicas")
    started = time.perf_counter()
    state.all_reduced_bytes += ex.zero.gather(ex.replicas, ex.timeout_s)
    # the gathered buffer is parameters, never a stashed activation (a new storage each step)
    ex.not_activations.discard(ex.gathered_key)
    ex.gathered_key = storage_key(ex.zero.flat)
    ex.not_activations.add(ex.gathered_key)
    state.waiting_s += time.perf_counter() - started


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
