"""The action interpreter: runs one worker's lowered action list for a training step.

Workers interpret, they do not decide: the order of every receive, compute and send comes from
the compiled plan. The interpreter only checks that the list is being obeyed (no compute before
its receive, no receive twice, no send of something not computed) and names the failing
action's position in the rank x time grid when anything goes wrong. Each action runs the handler
registered for its kind (runtime/worker/executor/handlers.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from atoll.core import collectives, linear_grads
from atoll.core.actions import Action, Kind
from atoll.core.config import WorkerSettings
from atoll.core.dataflow import Routes
from atoll.core.graphs import BlockGraph, StageGraph
from atoll.core.memory import GradientBytes, MemorySnapshot, storage_bytes, storage_key
from atoll.core.names import STEP_MODES
from atoll.core.optim import build_optimizer
from atoll.core.spans import WAIT, History, StepSpans
from atoll.core.split_layouts import Layouts
from atoll.core.wire import EdgeSpec, TensorSpec
from atoll.errors import InvalidInput
from atoll.worker.executor import checkpoint, compute, transfers, update  # noqa: F401 (they register their handlers)
from atoll.worker.executor.buckets import GradBuckets
from atoll.worker.executor.handlers import handler_of
from atoll.worker.executor.run import StepRun
from atoll.worker.executor.step import ActionFailed, StepState
from atoll.worker.executor.zero import ZeroShard
from atoll.worker.transports.gloo import Transport

__all__ = ["ActionFailed", "PipelineExecutor", "StageSetup"]


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
        actions: list[Action],
        recv_slots: dict[Action, int],
        settings: WorkerSettings,
        transport: Transport | None,
        device: torch.device,
        replica: int = 0,
        replicas: int = 1,
        base: frozenset[int] = frozenset(),
    ):
        """``base``: the ids of the parameters that are a resident base's tensors (held and counted
        by the base's own executor on this worker, runtime/worker/loader.py)."""
        self.rank = rank
        self.stages = {s.index: s for s in stages}
        self.loss = loss
        self.routes = routes
        self.flow = routes.flow
        self.stage_ranks = routes.stage_ranks
        self.microbatches = settings.microbatches
        self.actions = actions
        self.rematerialize = settings.rematerialize
        self.autocast = settings.precision == "bf16"
        """Mixed precision: stages compute under autocast to bfloat16 (atoll.core.precision)."""
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
        self.last_backward = {a.stage: a.microbatch for a in actions if a.kind.grads in ("weight", "both")}
        """Per stage, the microbatch whose backward (B, or W where it is split) ends its gradients."""
        self.timeout_s = settings.data_plane_timeout_s
        self.weight = settings.weight
        """Its share against other jobs' steps interleaved with its own (runtime/worker/interleave.py)."""
        self.interleaver = None
        """Set at load time for a job whose steps run an action at a time among other jobs' steps
        (runtime/worker/interleave.py, ``interleavable``); None: its steps run in the caller's thread."""
        self.device = device
        self.last_stage = self.flow.num_stages - 1
        self._lock = threading.Lock()
        # the optimizer's parameters: a frozen one gets no gradient, no state and no all-reduce
        held = [p for s in stages for _, p in s.graph.named_parameters()]
        self.stage_params = {s.index: [p for _, p in s.graph.named_parameters() if p.requires_grad] for s in stages}
        self.params = [p for ps in self.stage_params.values() for p in ps]
        self.fuse_linear_grads = {s: linear_grads.worth_fusing(ps) for s, ps in self.stage_params.items()}
        """Stages whose backward adds linear layers' weight gradients in place (atoll.core.linear_grads)."""
        self.split_layouts = {s: Layouts() for s in self.stage_params}
        """Each stage's split-backward analysis, kept across microbatches (atoll.core.split_layouts)."""
        self.base = base
        # ZeRO: the parameters move into one flat buffer; this replica's optimizer steps its shard
        self.zero = None
        if settings.zero and self.params:
            optimizer, args = settings.optimizer, settings.optimizer_args
            units = self._units() if settings.reshard_after_forward else None
            self.zero = ZeroShard(self.params, replica, replicas, optimizer, args, settings.zero, units)
        # a stage without parameters (an activation, a reshape) has nothing to optimize
        if self.zero is not None:
            self.optimizer = self.zero.optimizer
        else:
            self.optimizer = (
                build_optimizer(settings.optimizer, self.params, settings.optimizer_args) if self.params else None
            )
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
        # storages counted in their own categories, never as stashed activations (a ZeRO
        # parameter's is its unit's flat buffer, one storage for the job's life, resized at stage 3)
        sharded = {id(p) for p in self.zero.params} if self.zero is not None else set()
        self.not_activations = {storage_key(t) for t in held} | {storage_key(t) for t in self.recv_buffers}
        self.unsharded_parameter_bytes = storage_bytes(p for p in held if id(p) not in base | sharded)
        """The parameters held whole and for good: all but a base's and those ZeRO lays out."""
        self.saved_bytes: dict[tuple, int] = {}
        """Bytes each stage stashes for its backward, counted on its first run (compute._counted)."""
        self.outputs_checked: set[tuple] = set()
        """(stage, mode) whose outputs matched the plan's spec once: at fixed shapes, on every run."""
        self.buffer_bytes = sum(t.nbytes for t in self.recv_buffers)
        self._gradient_bytes = GradientBytes()
        self.optimizer_bytes = 0
        self.failure = ""
        """Set when a step fails part-way: the state is undefined, later steps are refused."""
        unknown = sorted({a.kind.code for a in actions if handler_of(a.kind) is None})
        if unknown:
            raise InvalidInput(f"rank {rank}: this worker has no handler for action kind {', '.join(unknown)}")
        self._labels = [(str(a), f"atoll {a}", a.kind.category, handler_of(a.kind)) for a in actions]
        """Per action of the list: its span name, profiler range, span category and handler."""
        self.history = History()
        """The spans of the last steps (atoll.core.spans), read by the controller's timelines."""

    def _units(self) -> dict[int, list[int]]:
        """ZeRO-3 with ``reshard_after_forward``: each stage's trainable parameters are a unit (their
        positions in ``self.params``)."""
        units, start = {}, 0
        for s, params in self.stage_params.items():
            units[s] = list(range(start, start + len(params)))
            start += len(params)
        return units

    # ------------------------------------------------------------------ load time

    def use_replicas(self, group) -> None:
        """Join the data-parallel replicas through ``group`` (gradients averaged each step)."""
        self.replicas = group
        if self.zero is None:
            tied = {id(p) for copies in self.tied.values() for p in copies}
            self.buckets = GradBuckets(self.stage_params, tied, group, self.timeout_s)

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
        storage = self.recv_region.untyped_storage()
        for key, spec, offset in offsets:
            # Not a view of the region: views share their base's autograd version counter, so a
            # write into one buffer (gloo's staged copy-in) would invalidate activations that
            # autograd saved from every other buffer. Each buffer counts its own writes, as the
            # separate allocations on CPU do.
            buffer = torch.empty(0, dtype=spec.torch_dtype, device=self.device)
            item = buffer.element_size()
            assert offset % item == 0
            out[key].append(buffer.set_(storage, offset // item, spec.shape))
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
        with self._lock:
            if self.failure:
                raise ActionFailed(f"rank {self.rank}: an earlier step failed ({self.failure}); submit the job again")
            run = StepRun(self, StepState(mode, self._split(inputs), self._split(targets), spans=StepSpans(step)))
            try:
                if self.interleaver is None:
                    with torch.set_grad_enabled(run.grad):  # once for the step (StepRun.grad)
                        while run.advance():
                            pass
                else:
                    self.interleaver.run(run)
                return run.result()
            finally:
                run.close()

    @property
    def interleavable(self) -> bool:
        """Whether this job's steps can run an action at a time among other jobs' steps in one
        thread: every wait is for a receive or a send of its own (gloo, on CPU), none for a
        collective, which would need its peers to take the jobs in the same order."""
        solo = self.replicas is None and self.island is None and not self.tied
        return solo and self.device.type == "cpu" and all(a.kind.category != "collective" for a in self.actions)

    def wait(self, handles, state: StepState, what: str | None = None) -> None:
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

    @property
    def parameter_bytes(self) -> int:
        """The parameter bytes this worker holds for the job now (ZeRO-3: its shard, and the
        whole buffer while a step has it gathered)."""
        return self.unsharded_parameter_bytes + (self.zero.parameter_bytes if self.zero is not None else 0)

    def observe(self, state: StepState, step: bool = False) -> None:
        gradients = (
            self.zero.gradient_bytes if self.zero is not None else self._gradient_bytes([p.grad for p in self.params])
        )
        snap = MemorySnapshot(
            parameters=self.parameter_bytes,
            gradients=gradients,
            optimizer=self.optimizer_bytes,
            activations=state.activation_bytes,
            buffers=self.buffer_bytes,
        )
        state.meter.observe(snap, len(state.stash), step)

    def _run(self, run, action: Action, state: StepState) -> None:
        if self.zero is not None and action.is_compute:
            update.wait_gathered(self, action, state)
        if self.island is None or not action.is_compute:
            run(self, action, state)
            return
        with collectives.bind(self.island):  # a sharded stage's graph runs its island's collectives
            try:
                run(self, action, state)
            finally:
                state.island_bytes += collectives.take_counted_bytes(self.island)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, torch.Tensor]:
        with self._lock:  # never mid-step
            return checkpoint.state_dict(self)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """This worker's tensors for a checkpoint (runtime/worker/executor/checkpoint.py)."""
        with self._lock:  # never mid-step
            return checkpoint.checkpoint_tensors(self)

    def restore(self, reader, cuts: dict) -> None:
        """Load this worker's part of a checkpoint (runtime/worker/executor/checkpoint.py)."""
        with self._lock:
            checkpoint.restore(self, reader, cuts)

    def close(self) -> None:
        for group in (self.transport, self.replicas, self.island):
            if group is not None:
                group.close()
        self.stages.clear()
        self.slots.clear()
