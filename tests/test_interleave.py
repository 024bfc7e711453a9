"""The worker's interleaver (runtime/worker/interleave.py) on stand-in steps: pure scheduling logic,
so the steps here are fakes with the four things it reads (their actions, waits, weight, deadline)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from atoll.worker.interleave import Interleaver


class _Gate:
    """A handle whose wait returns once ``release`` is called."""

    def __init__(self):
        self.released = threading.Event()

    def wait(self, timeout_s: float) -> None:
        if not self.released.wait(timeout_s):
            raise TimeoutError("gate never opened")


class _Run:
    """``actions`` actions; the first waits on ``gate`` if given; each logs ``name``."""

    def __init__(self, name, actions, log, weight=1.0, gate=None, fail_at=None):
        self.name, self.left, self.log, self.gate, self.fail_at = name, actions, log, gate, fail_at
        self.ex = SimpleNamespace(timeout_s=10.0, weight=weight)

    def next_waits(self):
        return [self.gate] if self.gate is not None and not self.gate.released.is_set() else []

    def advance(self) -> bool:
        if self.left == 0:
            return False  # the step's end
        if self.fail_at == self.left:
            raise RuntimeError(f"{self.name} broke")
        time.sleep(0.001)  # an action's work: longer than a waiting thread takes to wake
        self.log.append(self.name)
        self.left -= 1
        return True

    def failed(self, error):
        return RuntimeError(f"{self.name}: {error}")


def _run_together(runs):
    """Submit ``runs`` (held at their gate until all have arrived); the errors they raised."""
    interleaver = Interleaver()
    errors = {}

    def submit(run):
        try:
            interleaver.run(run)
        except Exception as e:  # noqa: BLE001 (returned)
            errors[run.name] = e

    threads = []
    for run in runs:
        threads.append(threading.Thread(target=submit, args=(run,)))
        threads[-1].start()
        while run not in [e.run for e in interleaver._entries] and threads[-1].is_alive():
            threads[-1].join(0.01)
    for run in runs:
        if run.gate is not None:
            run.gate.released.set()
    for t in threads:
        t.join(10)
    return errors


def test_ready_steps_share_the_thread_by_weight():
    log = []
    gate = _Gate()
    heavy = _Run("heavy", 60, log, weight=3.0, gate=gate)
    light = _Run("light", 60, log, weight=1.0, gate=gate)
    assert _run_together([heavy, light]) == {}
    assert log.count("heavy") == log.count("light") == 60
    first = log[:40]  # both always ready: three of the heavy job's actions to each of the light's
    assert first.count("heavy") == pytest.approx(30, abs=3), log  # equal weights: 20


def test_equal_weights_take_turns():
    log = []
    gate = _Gate()
    runs = [_Run(name, 10, log, gate=gate) for name in "abc"]
    assert _run_together(runs) == {}
    assert all(abs(log[:15].count(name) - 5) <= 2 for name in "abc"), log


def test_a_failing_step_ends_alone():
    log = []
    gate = _Gate()
    broken = _Run("broken", 10, log, gate=gate, fail_at=7)
    fine = _Run("fine", 10, log, gate=gate)
    errors = _run_together([broken, fine])
    assert list(errors) == ["broken"] and "broken broke" in str(errors["broken"])
    assert log.count("fine") == 10 and log.count("broken") == 3


def test_a_wait_that_fails_fails_its_step_through_the_run():
    class Broken:
        def wait(self, timeout_s):
            raise ConnectionError("peer gone")

    log = []
    run = _Run("cut", 3, log)
    run.next_waits = lambda: [Broken()]
    errors = _run_together([_Run("other", 2, log, gate=_Gate()), run])
    assert str(errors["cut"]) == "cut: peer gone" and log == ["other", "other"]
