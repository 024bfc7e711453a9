"""The worker's gang order: calls run by position, whatever order they arrive in."""

import threading
import time

import pytest

from atoll._turnstile import Turnstile
from atoll.errors import InvalidInput


def run_all(turnstile, seqs, hold_s=0.0):
    ran, lock = [], threading.Lock()

    def call(seq):
        with turnstile.turn(seq):
            with lock:
                ran.append(seq)
            time.sleep(hold_s)

    threads = [threading.Thread(target=call, args=(s,)) for s in seqs]
    for t in threads:
        t.start()
        time.sleep(0.01)  # arrive in the listed order
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
