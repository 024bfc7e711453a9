"""Handlers of the data-parallel replicas' collectives and of the optimizer step: ZeRO-3's gather
and release of the parameters, the gradient average and the step (plain, or ZeRO's sharded
one; runtime/worker/executor/zero.py)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from atoll.core import optim
from atoll.core.actions import Action, Kind
from atoll.core.memory import storage_bytes
from atoll.worker.executor.handlers import handles
from atoll.worker.executor.step import ActionFailed, StepState

if TYPE_CHECKING:
    from atoll.worker.executor.interpreter import PipelineExecutor


@handles(Kind.GATHER_PARAMS)
def gather_params(ex: PipelineExecutor, action: Action, state: StepState) -> None:
    """ZeRO-3: start gathering the whole parameters of the action's unit from the replicas'
    shards; the first compute on them waits for it (``wait_gathered``)."""
    if ex.replicas is None:
        raise ActionFailed(f"rank {ex.rank}: GATHER_PARAMS without ZeRO-3 replicas")
    unit = ex.zero.unit(action.stage) if ex.zero is not None else None
    if unit is not None:  # a rank or stage without trainable parameters has nothing to gather
        state.all_reduced_bytes += unit.start_gather(ex.replicas)


@handles(Kind.RELEASE_PARAMS)
def release_params(ex: PipelineExecutor, action: Action, state: StepState) -> None:
    """ZeRO-3: free the gathered parameters of the action's unit."""
    unit = ex.zero.unit(action.stage) if ex.zero is not None else None
    if unit is not None and unit.gathered:
        wait_gathered(ex, action, state)  # a gather no compute waited for (a backward an evaluation skips)
        unit.release()


def wait_gathered(ex: PipelineExecutor, action: Action, state: StepState) -> None:
    """Before a compute (or a release): its unit's gather, if one is in flight, has arrived."""
    unit = ex.zero.unit(action.stage)
    if unit is not None and unit.pending is not None:
        started = time.perf_counter()
        unit.wait_gathered(ex.timeout_s)
        state.waiting_s += time.perf_counter() - started


@handles(Kind.ALL_REDUCE_GRAD)
def all_reduce_grads(ex: PipelineExecutor, action: Action, state: StepState) -> None:
    """Average every gradient of this rank over the replicas: the same parameters in the same
    order on every replica (one plan), summed in place by one coalesced all-reduce."""
    if ex.replicas is None:
        raise ActionFailed(f"rank {ex.rank}: ALL_REDUCE_GRAD without a replica group")
    started = time.perf_counter()
    if ex.zero is not None:
        state.all_reduced_bytes += ex.zero.reduce(ex.replicas, ex.timeout_s, action.stage)
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
        optim.step(ex.optimizer)
    ex.optimizer_bytes = storage_bytes(
        t for st in ex.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)
    )
