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

from atoll.core import collectives
from atoll.core.actions import Action, Kind
from atoll.core.config import WorkerSettings
from atoll.core.dataflow import Routes
from atoll.core.graphs import BlockGraph, StageGraph
from atoll.core.memory import MemorySnapshot, storage_bytes, storage_key
from atoll.core.names import STEP_MODES
from atoll.core.optim import build_optimizer
from atoll.core.spans import WAIT, History, StepSpans
from atoll.core.wire import EdgeSpec, TensorSpec
from atoll.errors import InvalidInput
from atoll.worker.executor import checkpoint, compute, transfers, update  # noqa: F401 (they register their handlers)
from atoll.worker.executor.buckets import GradBuckets
from atoll.worker.executor.handlers import handler_of
from atoll.worker.executor.step import ActionFailed, StepState
from atoll.worker.executor.zero import ZeroShard
from atoll.worker.transports.gloo import DataPlaneError, Transport

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
        self.base = base
        # ZeRO: the parameters move into one flat buffer; this replica's optimizer steps its shard
        self.zero = (
            ZeroShard(self.params, replica, replicas, settings.optimizer, settings.optimizer_args, settings.zero)
            if settings.zero and self.params
            else None
        )
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
        # storages counted in their own categories, never as stashed activations; not a ZeRO-3
        # parameter's placeholder, which is freed at the first gather (its key could then name an
        # activation's storage): the gathered buffer is excluded each step (update.gather_params)
        sharded = {id(p) for p in self.zero.params} if self.zero is not None else set()
        kept = [t for t in held if id(t) not in sharded] + (
            [self.zero.flat] if self.zero and self.zero.flat is not None else []
        )
        self.not_activations = {storage_key(t) for t in kept} | {storage_key(t) for t in self.recv_buffers}
        self.unsharded_parameter_bytes = storage_bytes(p for p in held if id(p) not in base | sharded)
        """The parameters held whole and for good: all but a base's and those ZeRO lays out."""
        self.gathered_key = 0
        """ZeRO-3: the storage of the parameters gathered for the current step (update.gather_params)."""
        self.saved_bytes: dict[tuple, int] = {}
        """Bytes each stage stashes for its backward, counted on its first run (compute._counted)."""
        self.buffer_bytes = sum(t.nbytes for t in self.recv_buffers)
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
        gradients = self.zero.gradient_bytes if self.zero is not None else storage_bytes(p.grad for p in self.params)
        snap = MemorySnapshot(
            parameters=self.parameter_bytes,
            gradients=gradients,
            optimizer=self.optimizer_bytes,
            activations=state.activation_bytes,
            buffers=self.buffer_bytes,
        )
        state.meter.observe(snap, len(state.stash), step)

    def _run(self, run, action: Action, state: StepState) -> None:
        if self.island is None or not action.is_compute:
            run(self, action, state)
            return
        with collectives.bind(self.island):  # a sharded stage's graph runs its island's collectives
            try:
                run(self, action, state)
            finally:
                state.island_bytes += collectives.take_counted_bytes()

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


class StepRun:
    """One step of an executor's action list, run an action at a time: ``advance`` runs the next
    one (after the last, it waits for the sends) and says whether any is left; ``next_waits``
    names the data-plane handles the next one will wait on, so an interleaver runs another job's
    action until they are done."""

    def __init__(self, ex: PipelineExecutor, state: StepState):
        self.ex, self.state = ex, state
        self.started = time.perf_counter()
        self.cuda = ex.device.type == "cuda"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(ex.device)
        ex.history.add(state.spans)  # a failed step's spans show where it stopped
        # Each action is a named range in a torch profiler's trace, but only while one runs
        # (in any thread: the flag is process-wide; a torch without it always records):
        # record_function costs about 6 us per action, a fifth of a tiny stage's worker time.
        self.profiled = getattr(torch.autograd.profiler, "_is_profiler_enabled", True)
        self.position = 0
        self.ended = False
        self._skip()

    def _skip(self) -> None:
        """Move past the actions that do not run in this step's mode."""
        actions, mode = self.ex.actions, self.state.mode
        while self.position < len(actions) and not actions[self.position].kind.runs_in(mode):
            self.position += 1

    def next_waits(self) -> list:
        """The handles the next action (or the step's end) waits on."""
        if self.position == len(self.ex.actions) or self.ex.actions[self.position].kind is Kind.STEP:
            return self.state.sends
        action = self.ex.actions[self.position]
        if not action.is_compute or action.kind.direction is None:
            return []
        kind = Kind.RECV_F if action.kind.direction == "forward" else Kind.RECV_B
        pending = self.state.pending_recvs.get(Action(action.stage, kind, action.microbatch))
        return pending[1] if pending is not None else []

    def advance(self) -> bool:
        """Run the next action; False once the step is over (its sends waited for)."""
        ex, state = self.ex, self.state
        action = None
        try:
            if self.position == len(ex.actions):
                action = ex.actions[-1] if ex.actions else None
                ex.wait(state.sends, state, "sends")
                if self.cuda:
                    torch.cuda.current_stream(ex.device).synchronize()
                self.ended = True
                return False
            action = ex.actions[self.position]
            name, profiled, category, run = ex._labels[self.position]
            begun = time.time()
            with torch.set_grad_enabled(state.mode == "train"):
                if self.profiled:
                    with torch.profiler.record_function(profiled):
                        ex._run(run, action, state)
                else:
                    ex._run(run, action, state)
                state.spans.spans.append((name, category, begun, time.time()))
                if action.is_compute or action.kind.memory in ("observe", "gather"):
                    ex.observe(state, step=action.kind is Kind.STEP)
        except Exception as e:
            raise self.failed(e, action) from e
        self.position += 1
        self._skip()
        return True

    def failed(self, error: Exception, action: Action | None = None) -> ActionFailed:
        """The step failed at ``action`` (by default the next one): the executor refuses later steps."""
        ex = self.ex
        position = min(self.position, len(ex.actions) - 1)  # the step's end: named by its last action
        if action is None and position >= 0:
            action = ex.actions[position]
        where = f"rank {ex.rank}, action #{position} '{action}'" if action else f"rank {ex.rank}"
        kind = "data plane" if isinstance(error, DataPlaneError) else type(error).__name__
        ex.failure = f"{where} failed ({kind})"
        if ex.buckets is not None:
            ex.buckets.reset()
        return ActionFailed(f"{where} failed ({kind}): {error}")

    def result(self):
        """(per-microbatch losses, measured memory, the last stage's full-batch output), once ended."""
        state = self.state
        losses = [float(state.losses[m]) for m in sorted(state.losses)]
        outputs = [
            torch.cat([state.outputs[m][i] for m in sorted(state.outputs)]).cpu()
            for i in range(len(state.outputs[0]) if state.outputs else 0)
        ]
        measured = {
            "peak": state.meter.peak.as_dict(),
            **({"at_step": state.meter.at_step.as_dict()} if state.meter.at_step is not None else {}),
            "peak_stashed_microbatches": state.meter.peak_stashed_microbatches,
            "wall_s": time.perf_counter() - self.started,
            "waiting_s": state.waiting_s,
            "data_plane_bytes": {
                "sent": state.sent_bytes,
                "received": state.received_bytes,
                "all_reduced": state.all_reduced_bytes,
                "island_all_reduced": state.island_bytes,
            },
        }
        if self.cuda:  # the allocator's view, next to the executor's own accounting
            measured["cuda_max_allocated"] = torch.cuda.max_memory_allocated(self.ex.device)
        return losses, measured, outputs

    def close(self) -> None:
        """Drop what the step held, whether it ended or failed."""
        ex, state = self.ex, self.state
        if ex.zero is not None:
            ex.zero.zero_grad()
            if ex.zero.stage == 3 and ex.zero.flat is not None:  # an evaluation, or a failed step
                ex.zero.release()
        elif ex.optimizer is not None:
            ex.optimizer.zero_grad(set_to_none=True)
        state.stash.clear()
        state.weight_halves.clear()
        state.pending_recvs.clear()
