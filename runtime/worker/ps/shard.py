"""One server's replica of one shard: its keys' values and optimizer state, the vector clock of
the tasks' progress, and the consistency rule a pull waits on.

Consistency (Li et al., OSDI'14, section 3.2), with ``clock[j]`` the iterations of task ``j``
applied here and a pull made at iteration ``t``:
- ``sequential``: a push is held until every live task has pushed that iteration, then their mean
  is applied as one update (synchronous data parallelism); a pull waits until ``min(clock) >= t``.
- ``bounded`` (``max_delay`` τ): every push is applied when it comes (scaled by 1/tasks); a pull
  waits until every task has finished iteration ``t - τ - 1``, that is ``min(clock) >= t - τ``.
- ``eventual``: pushes applied when they come; a pull never waits.
Each pull reports its staleness, ``t - min(clock)`` (0 at best): the iterations of some task's
updates it trained without. A push is identified by (task, iteration): one sent again (after a
failover to another replica) is acknowledged and not applied twice.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from atoll.core.ps_layout import Key
from atoll.core.ps_rules import Consistency, UpdateRule
from atoll.errors import DeadlineExceeded, InvalidInput, NotFound
from atoll.worker.ps.optim import KeyState


@dataclass(slots=True)
class Push:
    dense: dict[str, torch.Tensor]
    """key -> gradient of the whole key."""
    sparse: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """key -> (unique row numbers inside the parameter, their gradients)."""


class ShardReplica:
    def __init__(
        self, keys: list[Key], values: dict[str, torch.Tensor], rule: UpdateRule, consistency: Consistency, tasks: int
    ):
        self.keys = {k.key: k for k in keys}
        missing = sorted(set(self.keys) - values.keys())
        if missing:
            raise InvalidInput(f"no initial value for keys {missing}")
        self.state = {name: KeyState(values[name], rule) for name in self.keys}
        self.consistency = consistency
        self.tasks = tasks
        self.clock = [0] * tasks
        self.live = set(range(tasks))
        self.pending: dict[int, Push] = {}
        """sequential: the pushes of the iteration under way, by task."""
        self.cond = threading.Condition()
        self.order = threading.Lock()
        """Held by each server while it applies a push and passes it down the chain, so every
        replica applies the shard's pushes in one order."""

    # ------------------------------------------------------------------ reads

    def pull(self, task: int, iteration: int, keys: list[str], rows: list[tuple[str, torch.Tensor]], no_wait: bool):
        """(values, clock, staleness, waited_s): ``keys`` whole, then each (key, rows) read by row."""
        self._check_task(task)
        for name in keys:
            self._key(name)
        for name, r in rows:
            self._rows_inside(name, r)
        start = time.monotonic()
        lag = self.consistency.lag()
        with self.cond:
            if lag is not None and not no_wait:
                deadline = start + self.consistency.wait_timeout_s
                while self._slowest() < iteration - lag:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise DeadlineExceeded(
                            f"pull at iteration {iteration} waited {self.consistency.wait_timeout_s}s for "
                            f"slower tasks (vector clock {self.clock})"
                        )
                    self.cond.wait(left)
            values = [self.state[n].value.clone() for n in keys]
            values += [self.state[n].value[r - self.keys[n].row_start].clone() for n, r in rows]
            clock = list(self.clock)
            staleness = max(0, iteration - self._slowest())
        return values, clock, staleness, time.monotonic() - start

    def _slowest(self) -> int:
        live = [self.clock[j] for j in self.live]
        return min(live) if live else 1 << 62

    # ------------------------------------------------------------------ writes

    def check(self, task: int, push: Push) -> None:
        """Refuse a malformed push before anything is applied or passed on."""
        self._check_task(task)
        for name, grad in push.dense.items():
            key = self._key(name)
            if key.sparse:
                raise InvalidInput(f"key {name!r} is sparse: push its rows, not the whole table")
            want = self.state[name].value
            if grad.shape != want.shape or grad.dtype != want.dtype:
                raise InvalidInput(
                    f"push to {name!r}: gradient {list(grad.shape)} {grad.dtype} where the key is "
                    f"{list(want.shape)} {want.dtype}"
                )
        for name, (rows, grad) in push.sparse.items():
            self._rows_inside(name, rows)
            want = self.state[name].value
            if grad.shape != (rows.numel(), *want.shape[1:]) or grad.dtype != want.dtype:
                raise InvalidInput(
                    f"push to {name!r}: {rows.numel()} rows of gradient {list(grad.shape)} {grad.dtype} where "
                    f"each row is {list(want.shape[1:])} {want.dtype}"
                )
            if rows.unique().numel() != rows.numel():
                raise InvalidInput(f"push to {name!r}: row numbers must be unique")

    def push(self, task: int, iteration: int, push: Push) -> bool:
        """Apply (or hold, under ``sequential``) task's push of ``iteration``. False: a duplicate."""
        with self.cond:
            if task not in self.live:
                raise InvalidInput(f"task {task} was dropped from this job: its pushes are refused")
            done = self.clock[task] + (task in self.pending)
            if iteration < done:
                return False
            if iteration > done:
                raise InvalidInput(f"task {task} pushed iteration {iteration} before {done}")
            if self.consistency.mode == "sequential":
                self.pending[task] = push
                self._apply_round()
            else:
                self._apply([push], 1.0 / self.tasks)
                self.clock[task] += 1
            self.cond.notify_all()
        return True

    def drop(self, task: int) -> None:
        """Wait no more for ``task`` (dead): an iteration under way completes without it."""
        with self.cond:
            self.live.discard(task)
            self.pending.pop(task, None)
            if self.consistency.mode == "sequential":
                self._apply_round()
            self.cond.notify_all()

    def _apply_round(self) -> None:
        if not self.pending or not self.live <= self.pending.keys():
            return
        order = sorted(self.pending)  # in task order: every replica sums the same way
        self._apply([self.pending[t] for t in order], 1.0 / len(order))
        for t in order:
            self.clock[t] += 1
        self.pending.clear()

    def _apply(self, pushes: list[Push], scale: float) -> None:
        for name, state in self.state.items():
            key = self.keys[name]
            if key.sparse:
                parts = [p.sparse[name] for p in pushes if name in p.sparse]
                if not parts:
                    continue
                rows = torch.cat([r for r, _ in parts]) - key.row_start
                grads = torch.cat([g for _, g in parts])
                unique, where = rows.unique(return_inverse=True)
                total = torch.zeros((unique.numel(), *grads.shape[1:]), dtype=grads.dtype).index_add_(0, where, grads)
                state.apply(total * scale, unique)
            else:
                grads = [p.dense[name] for p in pushes if name in p.dense]
                if grads:
                    state.apply(sum(grads[1:], grads[0]) * scale)

    # ------------------------------------------------------------------ copies (re-replication)

    def export(self) -> tuple[dict[str, torch.Tensor], list[int], dict[str, torch.Tensor]]:
        with self.cond:
            values = {}
            for name, s in self.state.items():
                values[name] = s.value.clone()
                values.update({f"{name}/{k}": t.clone() for k, t in s.state.items()})
            pending = {
                f"{t}/{kind}/{name}": g.clone()
                for t, p in self.pending.items()
                for kind, part in (
                    ("dense", p.dense),
                    ("rows", {n: r for n, (r, _) in p.sparse.items()}),
                    ("row_grads", {n: g for n, (_, g) in p.sparse.items()}),
                )
                for name, g in part.items()
            }
            return values, list(self.clock), pending

    def restore(self, values: dict[str, torch.Tensor], clock: list[int], pending: dict[str, torch.Tensor]) -> None:
        with self.cond:
            for name, s in self.state.items():
                s.value = values[name]
                for k in list(s.state):
                    s.state[k] = values[f"{name}/{k}"]
            self.clock = list(clock)
            self.pending = {}
            for label, t in pending.items():
                task, kind, name = label.split("/", 2)
                p = self.pending.setdefault(int(task), Push({}, {}))
                if kind == "dense":
                    p.dense[name] = t
                else:
                    rows, grads = p.sparse.get(name, (None, None))
                    p.sparse[name] = (t, grads) if kind == "rows" else (rows, t)

    # ------------------------------------------------------------------ checks

    def _check_task(self, task: int) -> None:
        if not 0 <= task < self.tasks:
            raise InvalidInput(f"task {task} is out of range: this job has tasks 0..{self.tasks - 1}")

    def _key(self, name: str) -> Key:
        key = self.keys.get(name)
        if key is None:
            raise NotFound(f"key {name!r} is not held by this shard (keys: {', '.join(sorted(self.keys)[:8])}...)")
        return key

    def _rows_inside(self, name: str, rows: torch.Tensor) -> None:
        key = self._key(name)
        if not key.sparse:
            raise InvalidInput(f"key {name!r} is dense: it is read and written whole")
        if rows.dtype != torch.int64 or rows.dim() != 1:
            raise InvalidInput(f"rows of {name!r} must be a 1-d int64 tensor, got {rows.dtype} {list(rows.shape)}")
        if rows.numel() and (int(rows.min()) < key.row_start or int(rows.max()) >= key.row_end):
            raise InvalidInput(f"rows of {name!r} must lie in [{key.row_start}, {key.row_end})")
