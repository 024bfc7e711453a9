"""One step of an executor's action list, run an action at a time (runtime/worker/executor/interpreter.py
runs it to the end; runtime/worker/interleave.py among other jobs' steps)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from atoll.core.actions import Action, Kind
from atoll.worker.executor.step import ActionFailed, StepState
from atoll.worker.transports.gloo import DataPlaneError

if TYPE_CHECKING:
    from atoll.worker.executor.interpreter import PipelineExecutor


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
        self.grad = state.mode == "train"
        """Autograd records in training steps only. The thread that runs the step sets it once
        (``PipelineExecutor.run_step``); an action sets it only where it differs (an interleaving
        thread runs other jobs' steps too): a context manager per action cost a tiny stage's
        worker about 3% of its CPU."""
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
            if torch.is_grad_enabled() is self.grad:
                self._run(run, action, profiled)
            else:
                with torch.set_grad_enabled(self.grad):
                    self._run(run, action, profiled)
            state.spans.spans.append((name, category, begun, time.time()))
            if action.is_compute or action.kind.memory in ("observe", "gather"):
                ex.observe(state, step=action.kind is Kind.STEP)
        except Exception as e:
            raise self.failed(e, action) from e
        self.position += 1
        self._skip()
        return True

    def _run(self, run, action: Action, profiled: str) -> None:
        if self.profiled:
            with torch.profiler.record_function(profiled):
                self.ex._run(run, action, self.state)
        else:
            self.ex._run(run, action, self.state)

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
            ex.zero.end_step()
        else:  # what optimizer.zero_grad(set_to_none=True) does, without its profiling wrappers (~40 us)
            for p in ex.params:
                p.grad = None
        state.stash.clear()
        state.weight_halves.clear()
        state.pending_recvs.clear()
