"""The action interpreter: runs one worker's lowered action list for a training step.

Workers interpret, they do not decide: the order of every receive, compute and send comes from
the compiled plan. The interpreter only checks that the list is being obeyed (no compute before
its receive, no receive twice, no send of something not computed) and names the failing
action's position in the rank x time grid when anything goes wrong.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from atoll._actions import STEP_MODES, Action, Kind
from atoll._graphs import BlockGraph, StageGraph, flatten
from atoll._memory import MemorySnapshot, PeakMeter, SavedTensors, storage_bytes, storage_key
from atoll._optim import build_optimizer
from atoll._transport import DataPlaneError, Handle, Transport
from atoll._wire import EdgeSpec

FORWARD_DIRECTION, BACKWARD_DIRECTION = 0, 1
MAX_TENSORS_PER_EDGE = 64


def edge_tag(edge: int, microbatch: int, microbatches: int, direction: int, index: int) -> int:
    """Unique data-plane tag of one tensor crossing edge ``edge`` (stage edge -> edge+1)."""
    return ((edge * microbatches + microbatch) * 2 + direction) * MAX_TENSORS_PER_EDGE + index


class ActionFailed(RuntimeError):
    """An action of the list failed; the message names rank, position and action."""


@dataclass(slots=True)
class _Stash:
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]  # flat stage outputs, or [loss] on the last stage
    nbytes: int


@dataclass(slots=True)
class _StepState:
    mode: str
    input_mbs: list[list[torch.Tensor]] | None
    target_mbs: list[list[torch.Tensor]] | None
    pending_recvs: dict[Action, tuple[list[torch.Tensor], list[Handle]]] = field(default_factory=dict)
    stash: dict[tuple[int, int], _Stash] = field(default_factory=dict)
    input_grads: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    sends: list[Handle] = field(default_factory=list)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Forward mode: the last stage's output per microbatch."""
    """Read once at the end of the step: reading each at once would make the host wait for the GPU."""
    activation_bytes: int = 0
    meter: PeakMeter = field(default_factory=PeakMeter)
    waiting_s: float = 0.0
    """Time spent blocked on the data plane: the measured bubble plus transfer time."""


@dataclass(kw_only=True, slots=True)
class StageSetup:
    """What a worker knows about one stage it runs."""

    index: int
    graph: StageGraph
    input: EdgeSpec
    output: EdgeSpec


class PipelineExecutor:
    def __init__(
        self,
        *,
        rank: int,
        stages: list[StageSetup],
        loss: BlockGraph | None,
        num_stages: int,
        stage_ranks: list[int],
        microbatches: int,
        actions: list[Action],
        recv_slots: dict[Action, int],
        optimizer: str,
        optimizer_args: dict,
        rematerialize: bool,
        transport: Transport | None,
        timeout_s: float,
        device: torch.device,
    ):
        self.rank = rank
        self.stages = {s.index: s for s in stages}
        self.loss = loss
        self.num_stages = num_stages
        self.stage_ranks = stage_ranks
        self.microbatches = microbatches
        self.actions = actions
        self.rematerialize = rematerialize
        self.transport = transport
        self.timeout_s = timeout_s
        self.device = device
        self.last_stage = num_stages - 1
        self._lock = threading.Lock()
        self.params = [p for s in stages for _, p in s.graph.named_parameters()]
        # a stage without parameters (an activation, a reshape) has nothing to optimize
        self.optimizer = build_optimizer(optimizer, self.params, optimizer_args) if self.params else None
        self.recv_slots = recv_slots
        self.recv_region: torch.Tensor | None = None
        """On CUDA: one allocation holding every receive buffer, exported once to cuda_ipc peers."""
        self.slots = self._allocate_slots(recv_slots)
        self.recv_buffers = [t for slot in sorted(self.slots) for t in self.slots[slot]]
        # storages counted in their own categories, never as stashed activations
        self._not_activations = {storage_key(t) for t in self.params} | {
            storage_key(t) for bufs in self.slots.values() for t in bufs
        }
        self.parameter_bytes = storage_bytes(self.params)
        self.buffer_bytes = sum(t.nbytes for bufs in self.slots.values() for t in bufs)
        self.optimizer_bytes = 0
        self.failure = ""
        """Set when a step fails part-way: the state is undefined, later steps are refused."""

    # ------------------------------------------------------------------ load time

    def _allocate_slots(self, recv_slots: dict[Action, int]) -> dict[int, list[torch.Tensor]]:
        """Receive buffers, once, from the compiled specs; the plan says which action uses which."""
        specs_of: dict[int, list] = {}
        for action, slot in recv_slots.items():
            specs = self._recv_specs(action)
            if slot in specs_of:
                if [t.shape for t in specs_of[slot]] != [s.shape for s in specs]:
                    raise ValueError(f"plan reuses receive slot {slot} for {action} with another shape")
                continue
            specs_of[slot] = specs
        if self.device.type != "cuda":
            return {slot: [s.empty(self.device) for s in specs] for slot, specs in specs_of.items()}
        # one region, so cuda_ipc peers open a single handle (see runtime/_cuda_ipc.py)
        align = 256
        offsets, total = [], 0
        for slot in sorted(specs_of):
            for spec in specs_of[slot]:
                offsets.append((slot, spec, total))
                total += -(-spec.nbytes // align) * align
        self.recv_region = torch.empty(max(total, align), dtype=torch.uint8, device=self.device)
        slots: dict[int, list[torch.Tensor]] = {slot: [] for slot in specs_of}
        for slot, spec, offset in offsets:
            raw = self.recv_region[offset : offset + spec.nbytes]
            slots[slot].append(raw.view(spec.torch_dtype).view(spec.shape))
        return slots

    def _recv_specs(self, action: Action):
        stage = self.stages[action.stage]
        if action.kind is Kind.RECV_F:
            return list(stage.input.tensors)
        return [stage.output.tensors[i] for i in stage.output.differentiable]

    # ------------------------------------------------------------------ one step

    def run_step(self, inputs: list[torch.Tensor] | None, targets: list[torch.Tensor] | None, mode: str = "train"):
        """Run the action list once (or its forward actions, see STEP_MODES); returns
        (per-microbatch losses, measured memory, the last stage's full-batch output in forward mode)."""
        if mode not in STEP_MODES:
            raise ValueError(f"unknown step mode {mode!r} (known: {', '.join(STEP_MODES)})")
        runs = STEP_MODES[mode]
        with self._lock:
            if self.failure:
                raise ActionFailed(f"rank {self.rank}: an earlier step failed ({self.failure}); submit the job again")
            started = time.perf_counter()
            cuda = self.device.type == "cuda"
            if cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            state = _StepState(mode, self._split(inputs), self._split(targets))
            position, action = -1, None
            try:
                with torch.set_grad_enabled(mode == "train"):
                    for position, action in enumerate(self.actions):  # noqa: B007 (read on failure)
                        if runs is not None and action.kind not in runs:
                            continue
                        self._run(action, state)
                        if action.is_compute or action.kind is Kind.STEP:
                            self._observe(state)
                self._wait(state.sends, state)
                losses = [float(state.losses[m]) for m in sorted(state.losses)]
                outputs = [
                    torch.cat([state.outputs[m][i] for m in sorted(state.outputs)]).cpu()
                    for i in range(len(state.outputs[0]) if state.outputs else 0)
                ]
                if cuda:
                    torch.cuda.current_stream(self.device).synchronize()
            except Exception as e:
                where = f"rank {self.rank}, action #{position} '{action}'" if action else f"rank {self.rank}"
                kind = "data plane" if isinstance(e, DataPlaneError) else type(e).__name__
                self.failure = f"{where} failed ({kind})"
                raise ActionFailed(f"{where} failed ({kind}): {e}") from e
            finally:
                if self.optimizer is not None:
                    self.optimizer.zero_grad(set_to_none=True)
                state.stash.clear()
                state.pending_recvs.clear()
            wall = time.perf_counter() - started
            measured = {
                "peak": state.meter.peak.as_dict(),
                "peak_stashed_microbatches": state.meter.peak_stashed_microbatches,
                "wall_s": wall,
                "waiting_s": state.waiting_s,
            }
            if cuda:  # the allocator's view, next to the executor's own accounting
                measured["cuda_max_allocated"] = torch.cuda.max_memory_allocated(self.device)
            return losses, measured, outputs

    def _wait(self, handles, state: _StepState) -> None:
        started = time.perf_counter()
        for handle in handles:
            handle.wait(self.timeout_s)
        state.waiting_s += time.perf_counter() - started

    def _split(self, tensors: list[torch.Tensor] | None) -> list[list[torch.Tensor]] | None:
        if tensors is None:
            return None
        chunks = [torch.tensor_split(t.to(self.device), self.microbatches, dim=0) for t in tensors]
        # copies: a microbatch view would keep the whole batch's storage alive until its backward
        return [[c[m].clone() for c in chunks] for m in range(self.microbatches)]

    def _observe(self, state: _StepState) -> None:
        snap = MemorySnapshot(
            parameters=self.parameter_bytes,
            gradients=storage_bytes(p.grad for p in self.params),
            optimizer=self.optimizer_bytes,
            activations=state.activation_bytes,
            buffers=self.buffer_bytes,
        )
        state.meter.observe(snap, len(state.stash))

    def _run(self, action: Action, state: _StepState) -> None:
        kind = action.kind
        if kind is Kind.RECV_F or kind is Kind.RECV_B:
            self._post_recv(action, state)
        elif kind is Kind.FORWARD:
            self._forward(action, state)
        elif kind is Kind.SEND_F:
            self._send_forward(action, state)
        elif kind is Kind.BACKWARD:
            self._backward(action, state)
        elif kind is Kind.SEND_B:
            self._send_backward(action, state)
        elif kind is Kind.STEP:
            self._optimizer_step(state)
        else:  # pragma: no cover - Kind is closed
            raise ValueError(f"unknown action kind {kind}")

    # ------------------------------------------------------------------ communication

    def _post_recv(self, action: Action, state: _StepState) -> None:
        if action in state.pending_recvs:
            raise RuntimeError(f"{action} posted twice in one step")
        buffers = self.slots[self.recv_slots[action]]
        s, m = action.stage, action.microbatch
        if action.kind is Kind.RECV_F:
            peer, edge, direction, indices = self.stage_ranks[s - 1], s - 1, FORWARD_DIRECTION, range(len(buffers))
        else:
            peer, edge, direction = self.stage_ranks[s + 1], s, BACKWARD_DIRECTION
            indices = self.stages[s].output.differentiable
        handles = [
            self.transport.recv(buf, peer, edge_tag(edge, m, self.microbatches, direction, i))
            for buf, i in zip(buffers, indices)
        ]
        state.pending_recvs[action] = (buffers, handles)

    def _take_recv(self, action: Action, state: _StepState) -> list[torch.Tensor]:
        try:
            buffers, handles = state.pending_recvs.pop(action)
        except KeyError:
            raise RuntimeError(f"compute needs {action}, which was not posted before it") from None
        self._wait(handles, state)
        return buffers

    def _send_forward(self, action: Action, state: _StepState) -> None:
        s, m = action.stage, action.microbatch
        stash = state.stash.get((s, m))
        if stash is None:
            raise RuntimeError(f"{action} before {s}F{m}")
        peer = self.stage_ranks[s + 1]
        for i, out in enumerate(stash.outputs):
            tag = edge_tag(s, m, self.microbatches, FORWARD_DIRECTION, i)
            state.sends.append(self.transport.send(out.detach().contiguous(), peer, tag))

    def _send_backward(self, action: Action, state: _StepState) -> None:
        s, m = action.stage, action.microbatch
        grads = state.input_grads.pop((s, m), None)
        if grads is None:
            raise RuntimeError(f"{action} before {s}B{m}")
        peer = self.stage_ranks[s - 1]
        for i, grad in zip(self.stages[s].input.differentiable, grads):
            tag = edge_tag(s - 1, m, self.microbatches, BACKWARD_DIRECTION, i)
            state.sends.append(self.transport.send(grad.contiguous(), peer, tag))

    # ------------------------------------------------------------------ compute

    def _is_local(self, edge: int) -> bool:
        """Stages ``edge`` and ``edge + 1`` both run here: a local hand-off, no transport."""
        return self.stage_ranks[edge] == self.stage_ranks[edge + 1]

    def _stage_inputs(self, action: Action, state: _StepState) -> list[torch.Tensor]:
        s, m = action.stage, action.microbatch
        if s == 0:
            return list(state.input_mbs[m])
        if self._is_local(s - 1):
            producer = state.stash.get((s - 1, m))
            if producer is None:
                raise RuntimeError(f"{action} takes the output of {s - 1}F{m}, which has not run on this rank")
            received = [t.detach() for t in producer.outputs]
        else:
            received = self._take_recv(Action(s, Kind.RECV_F, m), state)
        return [buf.detach().requires_grad_() if buf.is_floating_point() else buf for buf in received]

    def _counter(self, s: int, inputs: list[torch.Tensor]) -> SavedTensors:
        """Counts what a stage saves. A handed-off input is its producer's stashed output, counted
        there (as a received input is counted as a buffer), so it is not counted again."""
        if s > 0 and self._is_local(s - 1):
            return SavedTensors(self._not_activations | {storage_key(t) for t in inputs})
        return SavedTensors(self._not_activations)

    def _run_stage(self, s: int, m: int, inputs: list[torch.Tensor], state: _StepState) -> list[torch.Tensor]:
        out = self.stages[s].graph.forward(inputs)
        if s != self.last_stage or state.mode == "forward":
            return flatten(out)
        leaves = flatten(out) + list(state.target_mbs[m])
        args, kwargs = pytree.tree_unflatten(leaves, self.loss.in_spec)
        return [self.loss.module(*args, **kwargs)]

    def _forward(self, action: Action, state: _StepState) -> None:
        s, m = action.stage, action.microbatch
        if (s, m) in state.stash:
            raise RuntimeError(f"{action} computed twice")
        inputs = self._stage_inputs(action, state)
        counter = self._counter(s, inputs)
        if self.rematerialize:
            # keep only the inputs; backward recomputes the forward (GPipe re-materialization)
            with torch.no_grad():
                outputs = self._run_stage(s, m, inputs, state)
            counter.add(inputs)
        else:
            with counter:
                outputs = self._run_stage(s, m, inputs, state)
            counter.add(outputs)
        if s == self.last_stage and state.mode == "forward":
            state.outputs[m] = [t.detach() for t in outputs]
        elif s == self.last_stage:
            state.losses[m] = outputs[0].detach()
        else:
            self.stages[s].output.check(outputs)
        state.stash[(s, m)] = _Stash(inputs, outputs, counter.nbytes)
        state.activation_bytes += counter.nbytes

    def _backward(self, action: Action, state: _StepState) -> None:
        s, m = action.stage, action.microbatch
        stash = state.stash.pop((s, m), None)
        if stash is None:
            raise RuntimeError(f"{action} before {s}F{m}")
        outputs, recomputed = stash.outputs, 0
        if self.rematerialize:
            counter = self._counter(s, stash.inputs)
            with counter:
                outputs = self._run_stage(s, m, stash.inputs, state)
            counter.add(outputs)
            # the recomputed activations live only while this backward runs: observe them now
            recomputed = counter.nbytes
            state.activation_bytes += recomputed
            self._observe(state)
        if s == self.last_stage:
            torch.autograd.backward(outputs[0] / self.microbatches)
        elif self.stages[s].output.differentiable:  # an integer-only edge sends no gradient back
            if self._is_local(s):
                grads = state.input_grads.pop((s + 1, m), None)
                if grads is None:
                    raise RuntimeError(f"{action} takes the input gradients of {s + 1}B{m}, which has not run here")
            else:
                grads = self._take_recv(Action(s, Kind.RECV_B, m), state)
            pairs = [
                (outputs[i], g) for i, g in zip(self.stages[s].output.differentiable, grads) if outputs[i].requires_grad
            ]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        state.activation_bytes -= stash.nbytes + recomputed
        if s > 0:
            state.input_grads[(s, m)] = [
                stash.inputs[i].grad if stash.inputs[i].grad is not None else torch.zeros_like(stash.inputs[i])
                for i in self.stages[s].input.differentiable
            ]

    def _optimizer_step(self, state: _StepState) -> None:
        self._wait(state.sends, state)
        state.sends.clear()
        if self.optimizer is None:
            return
        self.optimizer.step()
        self.optimizer_bytes = storage_bytes(
            t for st in self.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)
        )

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, torch.Tensor]:
        with self._lock:  # never mid-step
            return {
                k: v.detach().clone() for stage in self.stages.values() for k, v in stage.graph.state_dict().items()
            }

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.stages.clear()
        self.slots.clear()
