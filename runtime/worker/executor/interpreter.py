"""The action interpreter: runs one worker's lowered action list for a training step.

Workers interpret, they do not decide: the order of every receive, compute and send comes from
the compiled plan. The interpreter only checks that the list is being obeyed (no compute before
its receive, no receive twice, no send of something not computed) and names the failing
action's position in the rank x time grid when anything goes wrong.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from atoll.core import collectives
from atoll.core.actions import STEP_MODES, Action, Kind
from atoll.core.dataflow import Routes
from atoll.core.graphs import BlockGraph, StageGraph, flatten
from atoll.core.memory import MemorySnapshot, PeakMeter, SavedTensors, storage_bytes, storage_key
from atoll.core.optim import build_optimizer
from atoll.core.spans import CATEGORY, WAIT, History, StepSpans
from atoll.core.wire import EdgeSpec, TensorSpec
from atoll.errors import InvalidInput
from atoll.worker.executor.buckets import GradBuckets
from atoll.worker.executor.zero import ZeroShard
from atoll.worker.transports.gloo import DataPlaneError, Handle, Transport

FORWARD_DIRECTION, BACKWARD_DIRECTION = 0, 1
MAX_TENSORS_PER_EDGE = 64
MAX_RANKS = 4096


def edge_tag(edge: int, microbatch: int, microbatches: int, direction: int, index: int) -> int:
    """Unique data-plane tag of the ``index``-th tensor of dataflow edge ``edge`` (its position in
    ``Dataflow.edges``) for one microbatch and direction."""
    return ((edge * microbatches + microbatch) * 2 + direction) * MAX_TENSORS_PER_EDGE + index


def tied_tag(num_edges: int, microbatches: int, group: int, sender: int) -> int:
    """Tag of one rank's gradient of one tied parameter; above every edge tag of the job."""
    return edge_tag(num_edges, 0, microbatches, 0, 0) + group * MAX_RANKS + sender


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """A stage input made by another stage: cut from the producer's graph, collecting its gradient."""
    t = t.detach()
    return t.requires_grad_() if t.is_floating_point() else t


class ActionFailed(RuntimeError):
    """An action of the list failed; the message names rank, position and action."""


@dataclass(slots=True)
class _Stash:
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]  # flat stage outputs, or [loss] on the last stage
    nbytes: int


@dataclass(slots=True)
class _InputGrads:
    by_position: dict[int, torch.Tensor]
    readers: int
    """Producers still to take them: one per local edge in, one SEND_B for all remote edges."""


@dataclass(slots=True)
class _StepState:
    mode: str
    input_mbs: list[list[torch.Tensor]] | None
    target_mbs: list[list[torch.Tensor]] | None
    pending_recvs: dict[Action, tuple[list[torch.Tensor], list[Handle]]] = field(default_factory=dict)
    stash: dict[tuple[int, int], _Stash] = field(default_factory=dict)
    input_grads: dict[tuple[int, int], _InputGrads] = field(default_factory=dict)
    sends: list[Handle] = field(default_factory=list)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Forward mode: the last stage's output per microbatch."""
    """Read once at the end of the step: reading each at once would make the host wait for the GPU."""
    activation_bytes: int = 0
    meter: PeakMeter = field(default_factory=PeakMeter)
    sent_bytes: int = 0
    received_bytes: int = 0
    """Tensor bytes this rank moved over its transports in the step (local hand-offs excluded)."""
    all_reduced_bytes: int = 0
    """Gradient bytes this rank put into the data-parallel all-reduce (what gloo moves for them
    depends on its algorithm)."""
    island_bytes: int = 0
    """Bytes this rank put into its tensor-parallel island's collectives."""
    waiting_s: float = 0.0
    """Time spent blocked on the data plane: the measured bubble plus transfer time."""
    spans: StepSpans = field(default_factory=lambda: StepSpans(0))


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
        routes: Routes,
        microbatches: int,
        actions: list[Action],
        recv_slots: dict[Action, int],
        optimizer: str,
        optimizer_args: dict,
        rematerialize: bool,
        transport: Transport | None,
        timeout_s: float,
        device: torch.device,
        replica: int = 0,
        replicas: int = 1,
        zero: bool = False,
    ):
        self.rank = rank
        self.stages = {s.index: s for s in stages}
        self.loss = loss
        self.routes = routes
        self.flow = routes.flow
        self.stage_ranks = routes.stage_ranks
        self.microbatches = microbatches
        self.actions = actions
        self.rematerialize = rematerialize
        self.transport = transport
        self.replicas = None
        """This rank's gloo group across the data-parallel replicas (ALL_REDUCE_GRAD), if any."""
        self.island_rank, self.island_size = 0, 1
        """This worker's place in its stage's tensor-parallel island."""
        self.island = None
        """The gloo group of this stage's tensor-parallel island, which its sharded graphs' collectives
        run in (atoll.core.collectives), if any."""
        self.buckets: GradBuckets | None = None
        """Without ZeRO: the gradient all-reduces started during each stage's last backward."""
        self._last_backward = {a.stage: a.microbatch for a in actions if a.kind is Kind.BACKWARD}
        self.timeout_s = timeout_s
        self.device = device
        self.last_stage = self.flow.num_stages - 1
        self._lock = threading.Lock()
        self.params = [p for s in stages for _, p in s.graph.named_parameters()]
        # ZeRO-1: the parameters move into one flat buffer; this replica's optimizer steps its shard
        self.zero = (
            ZeroShard(self.params, replica, replicas, optimizer, optimizer_args) if zero and self.params else None
        )
        # a stage without parameters (an activation, a reshape) has nothing to optimize
        if self.zero is not None:
            self.optimizer = self.zero.optimizer
        else:
            self.optimizer = build_optimizer(optimizer, self.params, optimizer_args) if self.params else None
        self.recv_slots = recv_slots
        self.recv_region: torch.Tensor | None = None
        """On CUDA: one allocation holding every receive buffer, exported once to cuda_ipc peers."""
        # per tied parameter held here: its copies on this rank, and a buffer per other holder
        self.tied = {
            g: [dict(self.stages[s].graph.named_parameters())[t.name] for s in t.stages if s in self.stages]
            for g, t in enumerate(self.flow.tied)
            if rank in routes.tied_ranks[g]
        }
        tied_specs = {
            ("tied", g, r): [self.flow.tied[g].spec] for g in self.tied for r in routes.tied_ranks[g] if r != rank
        }
        buffers = self._allocate({**self._slot_specs(recv_slots), **tied_specs})
        self.slots = {k: v for k, v in buffers.items() if isinstance(k, int)}
        self.tied_buffers = {k[1:]: v[0] for k, v in buffers.items() if not isinstance(k, int)}
        self.recv_buffers = [t for key in sorted(buffers, key=str) for t in buffers[key]]
        # storages counted in their own categories, never as stashed activations
        self._not_activations = {storage_key(t) for t in self.params} | {storage_key(t) for t in self.recv_buffers}
        self.parameter_bytes = storage_bytes(self.params)
        self.buffer_bytes = sum(t.nbytes for t in self.recv_buffers)
        self.optimizer_bytes = 0
        self.failure = ""
        """Set when a step fails part-way: the state is undefined, later steps are refused."""
        self._labels = [(str(a), f"atoll {a}", CATEGORY[a.kind]) for a in actions]
        """Per action of the list: its span name, profiler range and span category."""
        self.history = History()
        """The spans of the last steps (atoll.core.spans), read by the controller's timelines."""

    # ------------------------------------------------------------------ load time

    def use_replicas(self, group) -> None:
        """Join the data-parallel replicas through ``group`` (gradients averaged each step)."""
        self.replicas = group
        if self.zero is None:
            tied = {id(p) for copies in self.tied.values() for p in copies}
            by_stage = {s: [p for _, p in st.graph.named_parameters()] for s, st in self.stages.items()}
            self.buckets = GradBuckets(by_stage, tied, group, self.timeout_s)

    def _slot_specs(self, recv_slots: dict[Action, int]) -> dict[int, list[TensorSpec]]:
        """Receive buffers, once, from the compiled specs; the plan says which action uses which."""
        specs_of: dict[int, list[TensorSpec]] = {}
        for action, slot in recv_slots.items():
            if action.kind is Kind.RECV_F:
                specs = self.routes.recv_f_specs(action.stage)
            elif action.kind is Kind.RECV_B:
                specs = self.routes.recv_b_specs(action.stage)
            else:
                raise ValueError(f"plan gives a receive slot to {action}, which receives nothing")
            if slot in specs_of and [t.shape for t in specs_of[slot]] != [t.shape for t in specs]:
                raise ValueError(f"plan reuses receive slot {slot} for {action} with another shape")
            specs_of[slot] = specs
        return specs_of

    def _allocate(self, specs_of: dict) -> dict:
        if self.device.type != "cuda":
            return {key: [s.empty(self.device) for s in specs] for key, specs in specs_of.items()}
        # one region, so cuda_ipc peers open a single handle (see runtime/worker/transports/cuda_ipc.py)
        align = 256
        offsets, total = [], 0
        for key in sorted(specs_of, key=str):
            for spec in specs_of[key]:
                offsets.append((key, spec, total))
                total += -(-spec.nbytes // align) * align
        self.recv_region = torch.empty(max(total, align), dtype=torch.uint8, device=self.device)
        out: dict = {key: [] for key in specs_of}
        for key, spec, offset in offsets:
            raw = self.recv_region[offset : offset + spec.nbytes]
            out[key].append(raw.view(spec.torch_dtype).view(spec.shape))
        return out

    # ------------------------------------------------------------------ one step

    def run_step(
        self,
        inputs: list[torch.Tensor] | None,
        targets: list[torch.Tensor] | None,
        mode: str = "train",
        step: int = 0,
    ):
        """Run the action list once (or its forward actions, see STEP_MODES) as the client's step
        number ``step`` (1 = the job's first); returns (per-microbatch losses, measured memory,
        the last stage's full-batch output in forward mode)."""
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
            state = _StepState(mode, self._split(inputs), self._split(targets), spans=StepSpans(step))
            self.history.add(state.spans)  # a failed step's spans show where it stopped
            record = state.spans.spans.append
            position, action = -1, None
            try:
                with torch.set_grad_enabled(mode == "train"):
                    for position, action in enumerate(self.actions):  # noqa: B007 (read on failure)
                        if runs is not None and action.kind not in runs:
                            continue
                        name, profiled, category = self._labels[position]
                        begun = time.time()
                        with torch.profiler.record_function(profiled):
                            self._run(action, state)
                        record((name, category, begun, time.time()))
                        if action.is_compute or action.kind is Kind.STEP:
                            self._observe(state)
                self._wait(state.sends, state, "sends")
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
                if self.buckets is not None:
                    self.buckets.reset()
                raise ActionFailed(f"{where} failed ({kind}): {e}") from e
            finally:
                if self.zero is not None:
                    self.zero.zero_grad()
                elif self.optimizer is not None:
                    self.optimizer.zero_grad(set_to_none=True)
                state.stash.clear()
                state.pending_recvs.clear()
            wall = time.perf_counter() - started
            measured = {
                "peak": state.meter.peak.as_dict(),
                "peak_stashed_microbatches": state.meter.peak_stashed_microbatches,
                "wall_s": wall,
                "waiting_s": state.waiting_s,
                "data_plane_bytes": {
                    "sent": state.sent_bytes,
                    "received": state.received_bytes,
                    "all_reduced": state.all_reduced_bytes,
                    "island_all_reduced": state.island_bytes,
                },
            }
            if cuda:  # the allocator's view, next to the executor's own accounting
                measured["cuda_max_allocated"] = torch.cuda.max_memory_allocated(self.device)
            return losses, measured, outputs

    def _wait(self, handles, state: _StepState, what: str | None = None) -> None:
        """Wait for data-plane ``handles``; a wait for ``what`` is recorded as its own span."""
        started = time.time()
        for handle in handles:
            handle.wait(self.timeout_s)
        ended = time.time()
        state.waiting_s += ended - started
        if what is not None:
            state.spans.spans.append((f"{WAIT} {what}", WAIT, started, ended))

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
        if self.island is None or not action.is_compute:
            self._handlers[action.kind](self, action, state)
            return
        with collectives.bind(self.island):  # a sharded stage's graph runs its island's collectives
            try:
                self._handlers[action.kind](self, action, state)
            finally:
                state.island_bytes += collectives.take_counted_bytes()

    # ------------------------------------------------------------------ communication

    def _post_recv(self, action: Action, state: _StepState) -> None:
        if action in state.pending_recvs:
            raise RuntimeError(f"{action} posted twice in one step")
        buffers = iter(self.slots[self.recv_slots[action]])
        s, m = action.stage, action.microbatch
        handles = []
        if action.kind is Kind.RECV_F:
            for edge_id, e in self.routes.remote_in(s):
                for i in range(len(e.spec.tensors)):
                    tag = edge_tag(edge_id, m, self.microbatches, FORWARD_DIRECTION, i)
                    handles.append((next(buffers), self.stage_ranks[e.src], tag))
        else:
            for edge_id, e in self.routes.remote_out(s):
                for i in e.differentiable:
                    tag = edge_tag(edge_id, m, self.microbatches, BACKWARD_DIRECTION, i)
                    handles.append((next(buffers), self.stage_ranks[e.dst], tag))
        state.pending_recvs[action] = (
            [buf for buf, _, _ in handles],
            [self.transport.recv(buf, peer, tag) for buf, peer, tag in handles],
        )
        state.received_bytes += sum(buf.nbytes for buf, _, _ in handles)

    def _take_recv(self, action: Action, state: _StepState) -> list[torch.Tensor]:
        try:
            buffers, handles = state.pending_recvs.pop(action)
        except KeyError:
            raise RuntimeError(f"compute needs {action}, which was not posted before it") from None
        self._wait(handles, state, str(action))
        return buffers

    def _send_forward(self, action: Action, state: _StepState) -> None:
        s, m = action.stage, action.microbatch
        stash = state.stash.get((s, m))
        if stash is None:
            raise RuntimeError(f"{action} before {s}F{m}")
        for edge_id, e in self.routes.remote_out(s):
            for i, src_index in enumerate(e.src_indices):
                tag = edge_tag(edge_id, m, self.microbatches, FORWARD_DIRECTION, i)
                out = stash.outputs[src_index].detach().contiguous()
                state.sends.append(self.transport.send(out, self.stage_ranks[e.dst], tag))
                state.sent_bytes += out.nbytes

    def _send_backward(self, action: Action, state: _StepState) -> None:
        s, m = action.stage, action.microbatch
        grads = self._read_input_grads(s, m, action, state)
        for edge_id, e in self.routes.remote_in(s):
            for i in e.differentiable:
                tag = edge_tag(edge_id, m, self.microbatches, BACKWARD_DIRECTION, i)
                grad = grads[e.dst_indices[i]].contiguous()
                state.sends.append(self.transport.send(grad, self.stage_ranks[e.src], tag))
                state.sent_bytes += grad.nbytes

    def _read_input_grads(self, s: int, m: int, reader, state: _StepState) -> dict[int, torch.Tensor]:
        held = state.input_grads.get((s, m))
        if held is None:
            raise RuntimeError(f"{reader} takes the input gradients of {s}B{m}, which has not run here")
        held.readers -= 1
        if held.readers == 0:
            del state.input_grads[(s, m)]
        return held.by_position

    # ------------------------------------------------------------------ compute

    def _stage_inputs(self, action: Action, state: _StepState) -> list[torch.Tensor]:
        """The stage's flat inputs, each from its edge: the batch, a local producer's stash, or
        this microbatch's receive buffers. Inputs made by another stage become leaves that
        collect the gradient to send back."""
        s, m = action.stage, action.microbatch
        inputs: list[torch.Tensor | None] = [None] * len(self.stages[s].input.tensors)
        for _, e in self.routes.batch_in(s):
            if state.input_mbs is None:
                raise RuntimeError(f"{action} reads the batch input, which this rank was not sent")
            for i, j in zip(e.src_indices, e.dst_indices):
                inputs[j] = state.input_mbs[m][i]
        for _, e in self.routes.local_in(s):
            producer = state.stash.get((e.src, m))
            if producer is None:
                raise RuntimeError(f"{action} takes the output of {e.src}F{m}, which has not run on this rank")
            for i, j in zip(e.src_indices, e.dst_indices):
                inputs[j] = _leaf(producer.outputs[i])
        if self.routes.needs_recv_f(s):
            received = iter(self._take_recv(Action(s, Kind.RECV_F, m), state))
            for _, e in self.routes.remote_in(s):
                for j in e.dst_indices:
                    inputs[j] = _leaf(next(received))
        return inputs

    def _counter(self, s: int, inputs: list[torch.Tensor]) -> SavedTensors:
        """Counts what a stage saves. A handed-off input is its producer's stashed output, counted
        there (as a received input is counted as a buffer), so it is not counted again."""
        handed_over = {storage_key(inputs[j]) for _, e in self.routes.local_in(s) for j in e.dst_indices}
        return SavedTensors(self._not_activations, handed_over)

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

    def _output_grads(self, action: Action, state: _StepState) -> dict[int, torch.Tensor]:
        """Gradient of each output of a stage, summed over every edge that carried it away."""
        s, m = action.stage, action.microbatch
        grads: dict[int, torch.Tensor] = {}

        def add(position: int, grad: torch.Tensor) -> None:
            grads[position] = grad if position not in grads else grads[position] + grad

        for _, e in self.routes.local_out(s):
            if e.differentiable:
                taken = self._read_input_grads(e.dst, m, action, state)
                for i in e.differentiable:
                    add(e.src_indices[i], taken[e.dst_indices[i]])
        if self.routes.needs_recv_b(s):
            received = iter(self._take_recv(Action(s, Kind.RECV_B, m), state))
            for _, e in self.routes.remote_out(s):
                for i in e.differentiable:
                    add(e.src_indices[i], next(received))
        return grads

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
        final = self.buckets is not None and self._last_backward.get(s) == m
        with self.buckets.last_backward(s) if final else contextlib.nullcontext():
            if s == self.last_stage:
                torch.autograd.backward(outputs[0] / self.microbatches)
            else:
                pairs = [(outputs[i], g) for i, g in sorted(self._output_grads(action, state).items())]
                pairs = [(o, g) for o, g in pairs if o.requires_grad]
                if pairs:  # an integer-only edge sends no gradient back
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        state.activation_bytes -= stash.nbytes + recomputed
        readers = self.routes.grad_readers(s)
        if readers:
            state.input_grads[(s, m)] = _InputGrads(
                {
                    j: t.grad if t.grad is not None else torch.zeros_like(t)
                    for j, t in enumerate(stash.inputs)
                    if t.requires_grad
                },
                readers,
            )

    def _reduce_tied(self, action: Action, state: _StepState) -> None:
        """Sum each tied parameter's gradient over every copy, here and on the other ranks holding
        it, in rank order on every rank, so all copies get the same bits and stay equal."""
        for g, copies in self.tied.items():
            ranks = self.routes.tied_ranks[g]
            mine = copies[0].grad if copies[0].grad is not None else torch.zeros_like(copies[0])
            for p in copies[1:]:
                mine = mine + (p.grad if p.grad is not None else torch.zeros_like(p))
            parts = {self.rank: mine}
            handles = []
            num_edges = len(self.flow.edges)
            for r in ranks:
                if r != self.rank:
                    buf = self.tied_buffers[(g, r)]
                    handles.append(self.transport.recv(buf, r, tied_tag(num_edges, self.microbatches, g, r)))
                    handles.append(
                        self.transport.send(mine.contiguous(), r, tied_tag(num_edges, self.microbatches, g, self.rank))
                    )
                    state.received_bytes += buf.nbytes
                    state.sent_bytes += mine.nbytes
                    parts[r] = buf
            self._wait(handles, state)
            total = parts[ranks[0]].clone()
            for r in ranks[1:]:
                total += parts[r]
            for i, p in enumerate(copies):
                p.grad = total if i == 0 else total.clone()

    def _all_reduce_grads(self, action: Action, state: _StepState) -> None:
        """Average every gradient of this rank over the replicas: the same parameters in the same
        order on every replica (one plan), summed in place by one coalesced all-reduce."""
        if self.replicas is None:
            raise ActionFailed(f"rank {self.rank}: ALL_REDUCE_GRAD without a replica group")
        if self.zero is not None:
            started = time.perf_counter()
            state.all_reduced_bytes += self.zero.reduce(self.replicas, self.timeout_s)
            state.waiting_s += time.perf_counter() - started
            return
        started = time.perf_counter()
        state.all_reduced_bytes += self.buckets.finish()  # most went out during the backward
        state.waiting_s += time.perf_counter() - started

    def _optimizer_step(self, action: Action, state: _StepState) -> None:
        self._wait(state.sends, state, "sends")
        state.sends.clear()
        if self.optimizer is None:
            return
        if self.zero is not None:
            started = time.perf_counter()
            self.zero.step(self.replicas, self.timeout_s)
            state.waiting_s += time.perf_counter() - started
        else:
            self.optimizer.step()
        self.optimizer_bytes = storage_bytes(
            t for st in self.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)
        )

    _handlers = {
        Kind.RECV_F: _post_recv,
        Kind.RECV_B: _post_recv,
        Kind.FORWARD: _forward,
        Kind.SEND_F: _send_forward,
        Kind.BACKWARD: _backward,
        Kind.SEND_B: _send_backward,
        Kind.REDUCE_GRAD: _reduce_tied,
        Kind.ALL_REDUCE_GRAD: _all_reduce_grads,
        Kind.STEP: _optimizer_step,
    }
    """One handler per instruction kind (atoll.core.actions.Kind)."""

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, torch.Tensor]:
        with self._lock:  # never mid-step
            return {
                k: v.detach().clone() for stage in self.stages.values() for k, v in stage.graph.state_dict().items()
            }

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """This worker's parameters, buffers and optimizer state, keyed as atoll.core.checkpoint
        says (a tied parameter held twice here is written once: its copies are equal)."""
        with self._lock:  # never mid-step
            if self.zero is not None:
                raise InvalidInput(
                    "checkpoints of ZeRO-1 jobs are not built yet (their optimizer state is a flat shard)"
                )
            out, names = {}, {}
            for stage in self.stages.values():
                for name, p in stage.graph.named_parameters():
                    out[f"param/{name}"], names[id(p)] = p, name
                for name, b in stage.graph.named_buffers():
                    out[f"buffer/{name}"] = b
            for p, state in self.optimizer.state.items() if self.optimizer is not None else ():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        out[f"optim/{names[id(p)]}/{key}"] = value
                    elif value is not None:
                        raise InvalidInput(f"optimizer state {key!r} is a {type(value).__name__}, not a tensor")
            return {k: v.detach().clone() for k, v in out.items()}

    def restore(self, reader, cuts: dict) -> None:
        """Load weights and optimizer state from a checkpoint ``reader`` (atoll.core.checkpoint),
        cut for this worker's island rank where ``cuts`` says."""
        rank, ranks = self.island_rank, self.island_size

        def local(key: str, name: str, like: torch.Tensor) -> torch.Tensor:
            """``key`` cut as ``like`` (a parameter or buffer) is held here; a 0-d state (a step
            count) as it is."""
            full = reader.full(key, name)
            if full.dim() == 0:
                return full.clone()
            value = cuts[name].local(full, rank, ranks) if name in cuts else full
            if value.shape != like.shape:
                raise InvalidInput(f"checkpoint {key} has shape {list(full.shape)}, this job holds {list(like.shape)}")
            return value.to(like.dtype).clone()

        with self._lock, torch.no_grad():
            if self.zero is not None:
                raise InvalidInput("restoring a ZeRO-1 job is not built yet")
            for stage in self.stages.values():
                for name, p in stage.graph.named_parameters():
                    p.copy_(local(f"param/{name}", name, p))
                    if self.optimizer is None:
                        continue
                    prefix = f"optim/{name}/"
                    state = {k.removeprefix(prefix): k for k in reader.where if k.startswith(prefix)}
                    if state:
                        self.optimizer.state[p] = {key: local(k, name, p) for key, k in state.items()}
                for name, b in stage.graph.named_buffers():
                    b.copy_(local(f"buffer/{name}", name, b))

    def close(self) -> None:
        for group in (self.transport, self.replicas, self.island):
            if group is not None:
                group.close()
        self.stages.clear()
        self.slots.clear()
