"""Handlers of the kinds that move tensors between ranks: receives, sends, and the sum of tied
parameters' gradients across the ranks holding them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from atoll.core.actions import Action, Kind
from atoll.worker.executor.handlers import handles
from atoll.worker.executor.step import StepState
from atoll.worker.executor.tags import BACKWARD_DIRECTION, FORWARD_DIRECTION, edge_tag, tied_tag

if TYPE_CHECKING:
    from atoll.worker.executor.interpreter import PipelineExecutor


@handles(Kind.RECV_F)
@handles(Kind.RECV_B)
def post_recv(ex: PipelineExecutor, action: Action, state: StepState) -> None:
    if action in state.pending_recvs:
        raise RuntimeError(f"{action} posted twice in one step")
    buffers = iter(ex.slots[ex.recv_slots[action]])
    s, m = action.stage, action.microbatch
    handles_ = []
    if action.kind.direction == "forward":
        for edge_id, e in ex.routes.remote_in(s):
            for i in range(len(e.spec.tensors)):
                tag = edge_tag(edge_id, m, ex.microbatches, FORWARD_DIRECTION, i)
                handles_.append((next(buffers), ex.stage_ranks[e.src], tag))
    else:
        for edge_id, e in ex.routes.remote_out(s):
            for i in e.differentiable:
                tag = edge_tag(edge_id, m, ex.microbatches, BACKWARD_DIRECTION, i)
                handles_.append((next(buffers), ex.stage_ranks[e.dst], tag))
    state.pending_recvs[action] = (
        [buf for buf, _, _ in handles_],
        [ex.transport.recv(buf, peer, tag) for buf, peer, tag in handles_],
    )
    state.received_bytes += sum(buf.nbytes for buf, _, _ in handles_)


def take_recv(ex: PipelineExecutor, action: Action, state: StepState) -> list[torch.Tensor]:
    """The buffers of a posted receive, once its data has arrived."""
    try:
        buffers, waiting = state.pending_recvs.pop(action)
    except KeyError:
        raise RuntimeError(f"compute needs {action}, which was not posted before it") from None
    ex.wait(waiting, state, str(action))
    return buffers


@handles(Kind.SEND_F)
def send_forward(ex: PipelineExecutor, action: Action, state: StepState) -> None:
    s, m = action.stage, action.microbatch
    stash = state.stash.get((s, m))
    if stash is None:
        raise RuntimeError(f"{action} before {s}F{m}")
    for edge_id, e in ex.routes.remote_out(s):
        for i, src_index in enumerate(e.src_indices):
            tag = edge_tag(edge_id, m, ex.microbatches, FORWARD_DIRECTION, i)
            # in the edge's dtype: bfloat16 under mixed precision, else the output's own
            out = stash.outputs[src_index].detach().to(e.spec.tensors[i].torch_dtype).contiguous()
            state.sends.append(ex.transport.send(out, ex.stage_ranks[e.dst], tag))
            state.sent_bytes += out.nbytes


@handles(Kind.SEND_B)
def send_backward(ex: PipelineExecutor, action: Action, state: StepState) -> None:
    s, m = action.stage, action.microbatch
    grads = state.take_input_grads(s, m, action)
    for edge_id, e in ex.routes.remote_in(s):
        for i in e.differentiable:
            tag = edge_tag(edge_id, m, ex.microbatches, BACKWARD_DIRECTION, i)
            grad = grads[e.dst_indices[i]].to(e.spec.tensors[i].torch_dtype).contiguous()
            state.sends.append(ex.transport.send(grad, ex.stage_ranks[e.src], tag))
            state.sent_bytes += grad.nbytes


@handles(Kind.REDUCE_GRAD)
def reduce_tied(ex: PipelineExecutor, action: Action, state: StepState) -> None:
    """Sum each tied parameter's gradient over every copy, here and on the other ranks holding
    it, in rank order on every rank, so all copies get the same bits and stay equal."""
    for g, copies in ex.tied.items():
        ranks = ex.routes.tied_ranks[g]
        mine = copies[0].grad if copies[0].grad is not None else torch.zeros_like(copies[0])
        for p in copies[1:]:
            mine = mine + (p.grad if p.grad is not None else torch.zeros_like(p))
        parts = {ex.rank: mine}
        waiting = []
        num_edges = len(ex.flow.edges)
        for r in ranks:
            if r != ex.rank:
                buf = ex.tied_buffers[(g, r)]
                waiting.append(ex.transport.recv(buf, r, tied_tag(num_edges, ex.microbatches, g, r)))
                waiting.append(
                    ex.transport.send(mine.contiguous(), r, tied_tag(num_edges, ex.microbatches, g, ex.rank))
                )
                state.received_bytes += buf.nbytes
                state.sent_bytes += mine.nbytes
                parts[r] = buf
        ex.wait(waiting, state)
        total = parts[ranks[0]].clone()
        for r in ranks[1:]:
            total += parts[r]
        for i, p in enumerate(copies):
            p.grad = total if i == 0 else total.clone()
