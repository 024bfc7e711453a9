"""Weighted fair queueing of steps (controller/cluster/fairness.py), as pure logic: the order in which a
gate lets waiting steps go, with no cluster and no clock in the assertions."""

import threading
import time

import pytest

from atoll.controller.cluster.fairness import FairGate

SHARED = frozenset({"w0", "w1"})


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def dispatch_order(backlog: dict[str, tuple[float, int]], gate: FairGate | None = None, holder: str = "") -> list[str]:
    """Every job of ``backlog`` (name -> (weight, steps)) has all its steps waiting at a gate of one
    step in flight, behind a step of ``holder`` (another job unless named) that holds the workers;
    the order in which they then go."""
    gate, went, lock = gate or FairGate(), [], threading.Lock()
    gate.IN_FLIGHT = 1
    holder = holder or "holder"
    gate.enter(holder, SHARED, 1.0)

    def step(job: str, weight: float) -> None:
        gate.enter(job, SHARED, weight)
        with lock:
            went.append(job)

    threads = []
    for job, (weight, steps) in backlog.items():  # each job's steps all wait before the next job's arrive
        for _ in range(steps):
            threads.append(threading.Thread(target=step, args=(job, weight), daemon=True))
            threads[-1].start()
        _wait_until(lambda n=len(threads): len(gate._waiting) == n, f"{job}'s steps did not reach the gate")
    gate.leave(holder)
    for n in range(1, len(threads) + 1):  # one at a time: each step finishes before the next goes
        _wait_until(lambda n=n: len(went) == n, f"step {n} never went: {went}")
        gate.leave(went[n - 1])
    for t in threads:
        t.join(10)
    return went


@pytest.mark.timeout(60)
def test_equal_weights_take_turns():
    assert dispatch_order({"a": (1.0, 6), "b": (1.0, 6), "c": (1.0, 6)}) == ["a", "b", "c"] * 6


@pytest.mark.timeout(60)
def test_weights_two_to_one_get_two_steps_to_one():
    order = dispatch_order({"heavy": (2.0, 20), "light": (1.0, 10)})
    for n in range(1, len(order) + 1):  # in every prefix, heavy has had twice light's steps, give or take
        heavy, light = order[:n].count("heavy"), order[:n].count("light")
        assert -1 <= heavy - 2 * light <= 2, order[:n]


@pytest.mark.timeout(60)
def test_a_job_back_from_idle_banks_no_credit():
    """A job arriving while another has run 8 steps alone starts at that job's virtual time: they
    take turns from then on, rather than the newcomer running 8 steps in a row to catch up."""
    gate = FairGate()
    for _ in range(8):
        gate.enter("busy", SHARED, 1.0)
        gate.leave("busy")
    order = dispatch_order({"late": (1.0, 6), "busy": (1.0, 6)}, gate, holder="busy")
    assert order == ["late", "busy"] * 6
