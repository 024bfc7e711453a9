"""Handlers of the compute kinds: a stage's forward and backward on one microbatch, with its
inputs taken from the batch, a local producer or a receive, and its activations accounted."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from atoll.core import linear_grads, split_backward
from atoll.core.actions import Action, Kind
from atoll.core.memory import SavedTensors, storage_key
from atoll.core.precision import as_specified, mixed_precision
from atoll.worker.executor.handlers import handles
from atoll.worker.executor.step import InputGrads, Stash, StepState
from atoll.worker.executor.transfers import take_recv

if TYPE_CHECKING:
    from atoll.worker.executor.interpreter import PipelineExecutor


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """A stage input made by another stage: cut from the producer's graph, collecting its gradient."""
    t = t.detach()
    return t.requires_grad_() if t.is_floating_point() else t


def _stage_inputs(ex: PipelineExecutor, action: Action, state: StepState) -> list[torch.Tensor]:
    """The stage's flat inputs, each from its edge: the batch, a local producer's stash, or
    this microbatch's receive buffers. Inputs made by another stage become leaves that
    collect the gradient to send back."""
    s, m = action.stage, action.microbatch
    inputs: list[torch.Tensor | None] = [None] * len(ex.stages[s].input.tensors)
    for _, e in ex.routes.batch_in(s):
        if state.input_mbs is None:
            raise RuntimeError(f"{action} reads the batch input, which this rank was not sent")
        for i, j in zip(e.src_indices, e.dst_indices):
            inputs[j] = state.input_mbs[m][i]
    for _, e in ex.routes.local_in(s):
        producer = state.stash.get((e.src, m))
        if producer is None:
            raise RuntimeError(f"{action} takes the output of {e.src}F{m}, which has not run on this rank")
        for i, j in zip(e.src_indices, e.dst_indices):
            inputs[j] = _leaf(producer.outputs[i])
    if ex.routes.needs_recv_f(s):
        received = iter(take_recv(ex, Action(s, Kind.RECV_F, m), state))
        own = ex.stages[s].input.tensors
        for _, e in ex.routes.remote_in(s):
            for j in e.dst_indices:  # in the stage's own dtype (mixed precision: upcast from bfloat16)
                inputs[j] = _leaf(next(received).to(own[j].torch_dtype))
    return inputs


def _counter(ex: PipelineExecutor, s: int, inputs: list[torch.Tensor]) -> SavedTensors:
    """Counts what a stage saves. A handed-off input is its producer's stashed output, counted
    there (as a received input is counted as a buffer), so it is not counted again."""
    handed_over = {storage_key(inputs[j]) for _, e in ex.routes.local_in(s) for j in e.dst_indices}
    return SavedTensors(ex.not_activations, handed_over)


def _counted(ex: PipelineExecutor, s: int, m: int, inputs: list[torch.Tensor], state: StepState, why: str):
    """Run stage ``s`` on microbatch ``m`` with autograd recording; returns its outputs and the
    bytes it stashes for its backward (what autograd saves, and the outputs). An exported graph
    at fixed shapes (the plan's, which every batch is checked against) saves the same storages on
    every run, so they are counted with saved-tensor hooks on the first run of each stage and
    mode, and that figure is used after:
    the hooks cost a Python call per saved tensor, about a tenth of a small stage's worker CPU
    (2.3 of 25 ms per step on the GPT example under DP=8 here)."""
    key = (s, state.mode, why)
    nbytes = ex.saved_bytes.get(key)
    if nbytes is not None:
        return _run_stage(ex, s, m, inputs, state), nbytes
    counter = _counter(ex, s, inputs)
    with counter:
        outputs = _run_stage(ex, s, m, inputs, state)
    counter.add(outputs)
    ex.saved_bytes[key] = counter.nbytes
    return outputs, counter.nbytes


def _run_stage(ex: PipelineExecutor, s: int, m: int, inputs: list[torch.Tensor], state: StepState):
    with mixed_precision(ex.autocast, ex.device):
        out = list(ex.stages[s].graph.forward(inputs))  # flat, as the plan's output spec (checked at compile)
        if s != ex.last_stage or state.mode == "forward":
            return as_specified(out, ex.stages[s].output) if ex.autocast else out
        return [_on_own_storage(t) for t in ex.loss.call_flat(out + list(state.target_mbs[m]))]


def _on_own_storage(loss: torch.Tensor) -> torch.Tensor:
    """The loss on a storage of its own size. Some CPU kernels return the 0-dim loss on the storage
    of their whole elementwise buffer (``aten.mse_loss`` with its mean: 2 KiB for a 32 x 16
    microbatch), which the stashed loss would keep alive until its backward, and which the
    compiler's fake kernels (the scalar alone) do not predict. The copy's backward passes the
    gradient through; the buffer is freed at once."""
    if loss.untyped_storage().nbytes() <= loss.nbytes:
        return loss
    return loss.clone()


@handles(Kind.FORWARD)
def forward(ex: PipelineExecutor, action: Action, state: StepState) -> None:
    s, m = action.stage, action.microbatch
    if (s, m) in state.stash:
        raise RuntimeError(f"{action} computed twice")
    inputs = _stage_inputs(ex, action, state)
    if ex.rematerialize:
        # keep only the inputs; backward recomputes the forward (GPipe re-materialization)
        with torch.no_grad():
            outputs = _run_stage(ex, s, m, inputs, state)
        counter = _counter(ex, s, inputs)
        counter.add(inputs)
        nbytes = counter.nbytes
    else:
        outputs, nbytes = _counted(ex, s, m, inputs, state, "forward")
    if s == ex.last_stage and state.mode == "forward":
        state.outputs[m] = [t.detach() for t in outputs]
    elif s == ex.last_stage:
        state.losses[m] = outputs[0].detach()
    elif (s, state.mode) not in ex.outputs_checked:
        ex.stages[s].output.check(outputs)
        ex.outputs_checked.add((s, state.mode))
    state.stash[(s, m)] = Stash(inputs, outputs, nbytes)
    state.activation_bytes += nbytes


def _output_grads(ex: PipelineExecutor, action: Action, state: StepState) -> dict[int, torch.Tensor]:
    """Gradient of each output of a stage, summed over every edge that carried it away."""
    s, m = action.stage, action.microbatch
    grads: dict[int, torch.Tensor] = {}

    def add(position: int, grad: torch.Tensor) -> None:
        grads[position] = grad if position not in grads else grads[position] + grad

    for _, e in ex.routes.local_out(s):
        if e.differentiable:
            taken = state.take_input_grads(e.dst, m, action)
            for i in e.differentiable:
                add(e.src_indices[i], taken[e.dst_indices[i]])
    if ex.routes.needs_recv_b(s):
        received = iter(take_recv(ex, Action(s, Kind.RECV_B, m), state))
        for _, e in ex.routes.remote_out(s):
            for i in e.differentiable:
                add(e.src_indices[i], next(received))
    return grads


def _roots(ex: PipelineExecutor, action: Action, state: StepState, outputs) -> tuple[list, list | None]:
    """Where a stage's backward starts: its loss (over the microbatch count) on the last stage, or
    its outputs with their gradients (None for the loss). An integer-only edge has no gradient."""
    if action.stage == ex.last_stage:
        return [outputs[0] / ex.microbatches], None
    # a gradient received in bfloat16 (mixed precision) in its output's dtype
    pairs = [(outputs[i], g.to(outputs[i].dtype)) for i, g in sorted(_output_grads(ex, action, state).items())]
    pairs = [(o, g) for o, g in pairs if o.requires_grad]
    return [o for o, _ in pairs], [g for _, g in pairs]


def _keep_input_grads(ex: PipelineExecutor, s: int, m: int, stash: Stash, state: StepState) -> None:
    """The gradients of the stage's inputs made by other stages, for their readers."""
    readers = ex.routes.grad_readers(s)
    if readers:
        state.input_grads[(s, m)] = InputGrads(
            {
                j: t.grad if t.grad is not None else torch.zeros_like(t)
                for j, t in enumerate(stash.inputs)
                if t.requires_grad
            },
            readers,
        )


def _armed(ex: PipelineExecutor, s: int, m: int):
    """The data-parallel buckets take the stage's final gradients during its last backward."""
    final = ex.buckets is not None and ex.last_backward.get(s) == m
    return ex.buckets.last_backward(s) if final else contextlib.nullcontext()


def _ready(ex: PipelineExecutor):
    """What a backward that adds gradients itself tells when one is added: the data-parallel
    buckets' hook (autograd's accumulation calls it for the rest), or nothing without replicas."""
    return ex.buckets.ready if ex.buckets is not None else None


@handles(Kind.BACKWARD)
def backward(ex: PipelineExecutor, action: Action, state: StepState) -> None:
    s, m = action.stage, action.microbatch
    stash = state.stash.pop((s, m), None)
    if stash is None:
        raise RuntimeError(f"{action} before {s}F{m}")
    outputs, recomputed = stash.outputs, 0
    if ex.rematerialize:
        outputs, recomputed = _counted(ex, s, m, stash.inputs, state, "recompute")
        # the recomputed activations live only while this backward runs: observe them now
        state.activation_bytes += recomputed
        ex.observe(state)
    roots, grads = _roots(ex, action, state, outputs)
    with _armed(ex, s, m):
        if roots and ex.fuse_linear_grads[s]:
            linear_grads.backward(roots, grads, None, _ready(ex))
        elif roots:
            torch.autograd.backward(roots, grads)
    state.activation_bytes -= stash.nbytes + recomputed
    _keep_input_grads(ex, s, m, stash, state)


@handles(Kind.BACKWARD_INPUT)
def backward_input(ex: PipelineExecutor, action: Action, state: StepState) -> None:
    """The input half of a split backward: the input gradients now (sent by the SEND_B after
    it), and what the weight half needs kept (atoll.core.split_backward); the stash stays."""
    s, m = action.stage, action.microbatch
    stash = state.stash.get((s, m))
    if stash is None:
        raise RuntimeError(f"{action} before {s}F{m}")
    if (s, m) in state.weight_halves:
        raise RuntimeError(f"{action} computed twice")
    roots, grads = _roots(ex, action, state, stash.outputs)
    half = split_backward.backward_input(roots, grads, stash.inputs, ex.stage_params[s], ex.split_layouts[s])
    held = split_backward.held_bytes(half, grads, ex.not_activations)
    state.weight_halves[(s, m)] = (half, held)
    state.activation_bytes += held
    _keep_input_grads(ex, s, m, stash, state)


@handles(Kind.BACKWARD_WEIGHT)
def backward_weight(ex: PipelineExecutor, action: Action, state: StepState) -> None:
    """The weight half: accumulates the stage's parameter gradients and frees the microbatch."""
    s, m = action.stage, action.microbatch
    taken = state.weight_halves.pop((s, m), None)
    if taken is None:
        raise RuntimeError(f"{action} before {s}I{m}")
    half, held = taken
    stash = state.stash.pop((s, m))
    with _armed(ex, s, m):
        split_backward.backward_weight(half, ex.stage_params[s], ex.fuse_linear_grads[s], _ready(ex))
    state.activation_bytes -= stash.nbytes + held
