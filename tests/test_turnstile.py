"""The worker's gang order: calls run by position, whatever order they arrive in."""

import threading
import time

import pytest

from atoll.errors import InvalidInput
from atoll.worker.turnstile import Turnstile


def run_all(turnstile, seqs, hold_s=0.0):
    """Calls for ``seqs``, arriving in the listed order (each is at the turnstile before the next
    starts); with ``hold_s``, each call, once it runs, holds its turn until every call has
    arrived and then ``hold_s`` longer."""
    ran, lock, all_arrived = [], threading.Lock(), threading.Event()

    def call(seq):
        with turnstile.turn(seq):
            with lock:
                ran.append(seq)
            if hold_s:
                all_arrived.wait(10)
                time.sleep(hold_s)

    threads = [threading.Thread(target=call, args=(s,)) for s in seqs]
    for seq, t in zip(seqs, threads):
        t.start()
        deadline = time.monotonic() + 10
        while not (seq in turnstile._present or seq in ran or seq in turnstile.skipped):
            assert time.monotonic() < deadline, f"call {seq} never reached the turnstile"
            time.sleep(0.001)
    all_arrived.set()
    for t in threads:
        t.join(10)
    return ran


def test_calls_run_in_position_order_not_arrival_order():
    assert run_all(Turnstile(), [3, 1, 4, 2, 5]) == [1, 2, 3, 4, 5]


def test_a_position_that_never_arrives_is_skipped_after_its_deadline():
    turnstile = Turnstile(missing_timeout_s=0.3)
    assert run_all(turnstile, [1, 3, 4]) == [1, 3, 4]
    assert turnstile.skipped == [2]
    with pytest.raises(InvalidInput, match="gang position 2 arrived after position 4 ran"):
        with turnstile.turn(2):
            pass


def test_waiting_behind_a_running_call_has_no_deadline():
    turnstile = Turnstile(missing_timeout_s=0.1)
    assert run_all(turnstile, [1, 2, 3], hold_s=0.3) == [1, 2, 3]  # each waits longer than 0.1 s
    assert turnstile.skipped == []


def test_unordered_calls_take_no_turn_and_reset_restarts_numbering():
    turnstile = Turnstile()
    with turnstile.turn(0):
        pass
    assert run_all(turnstile, [1, 2]) == [1, 2]
    turnstile.reset()
    assert run_all(turnstile, [1]) == [1]


def test_positions_below_the_controllers_floor_are_skipped_at_once():
    """Position 2 ended at the controller without reaching this worker (floor 3 on position 3):
    no deadline is waited out, however long it is. The floor's own position is still awaited."""
    turnstile = Turnstile(missing_timeout_s=600)
    with turnstile.turn(1):
        pass
    with turnstile.turn(3, floor=3):
        pass
    assert turnstile.skipped == [2]
    ran = []

    def five():
        with turnstile.turn(5, floor=4):
            ran.append(5)

    later = threading.Thread(target=five)
    later.start()
    later.join(0.3)
    assert ran == []  # 4 may still come: 5 waits for it
    with turnstile.turn(4):
        ran.append(4)
    later.join(10)
    assert ran == [4, 5] and turnstile.skipped == [2]


def _call_in_thread(turnstile, seq, started=None, release=None):
    """A call for ``seq`` in a thread: it records whether it ran or its error, and holds its turn
    until ``release`` is set."""
    outcome = {}

    def call():
        try:
            with turnstile.turn(seq):
                outcome["ran"] = True
                if started is not None:
                    started.set()
                if release is not None:
                    release.wait(10)
        except Exception as e:  # noqa: BLE001 (the test reads it)
            outcome["error"] = e

    thread = threading.Thread(target=call)
    thread.start()
    return thread, outcome


def test_a_new_registration_fails_the_old_controllers_waiting_calls_and_a_running_one_keeps_out_of_the_way():
    turnstile, started, release = Turnstile(), threading.Event(), threading.Event()
    running, ran = _call_in_thread(turnstile, 1, started, release)
    assert started.wait(10)
    waiting, waited = _call_in_thread(turnstile, 3)  # 2 never comes: 3 waits for it
    time.sleep(0.05)
    turnstile.reset()  # the worker registered with a restarted controller
    waiting.join(10)
    assert "ran" not in waited and "no longer serves" in str(waited["error"])
    assert run_all(turnstile, [2, 1]) == [1, 2]  # the new numbering runs beside the old call
    release.set()
    running.join(10)
    assert ran == {"ran": True}
    assert run_all(turnstile, [3]) == [3]  # the old call's end did not move the new order


def test_release_lets_the_order_go_past_a_call_stuck_in_its_turn():
    turnstile, started, release = Turnstile(), threading.Event(), threading.Event()
    stuck, _ = _call_in_thread(turnstile, 1, started, release)
    assert started.wait(10)
    assert not turnstile.release(2)  # not the running call
    assert turnstile.release(1)
    assert run_all(turnstile, [2, 3]) == [2, 3]  # while 1 still holds its thread
    release.set()
    stuck.join(10)
    assert run_all(turnstile, [4]) == [4]
