"""atoll.cli.stop_signal: SIGTERM and Ctrl-C end ``atoll status --watch`` and the daemons at once,
whichever thread the kernel hands the signal to and whatever the main thread holds when it comes.
The signals here go to this process (pytest runs tests on its main thread); each test gives the
signals back to the handlers they had."""

import os
import signal
import threading
import time

import pytest

from atoll.cli.stop_signal import STOP_SIGNALS, StopSignal


@pytest.mark.parametrize("sig", STOP_SIGNALS, ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_the_main_thread_holds_a_lock_sets_the_flag(sig):
    """CPython runs the handler between any two bytecodes of the main thread; ``status --watch``'s
    handler was ``threading.Event.set``, which deadlocks when Ctrl-C comes while ``Event.wait`` holds
    the event's lock (once in CI, the command was still running 20 s after its Ctrl-C). This
    handler takes none."""
    with StopSignal() as stop, threading.Lock():  # where Event.wait held its lock
        os.kill(os.getpid(), sig)
        sum(range(10))  # bytecodes: the handler runs here
        assert stop.stopped and stop.wait(0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sig", STOP_SIGNALS, ids=["SIGTERM", "SIGINT"])
def test_a_signal_another_thread_takes_ends_the_wait(sig, monkeypatch):
    """The kernel may deliver a process's signal to any thread; the main thread, blocked in
    ``wait``, wakes for it through the wakeup fd: its own looks at the flag and its timeout are
    put past the test's deadline here."""
    monkeypatch.setattr(StopSignal, "LOOK_S", 600.0)
    with StopSignal() as stop:

        def kill_self_later():  # once the main thread is in its select, in all likelihood
            time.sleep(0.3)
            signal.pthread_kill(threading.get_ident(), sig)

        other = threading.Thread(target=kill_self_later)
        other.start()
        assert stop.wait(600) is True
        other.join()


def test_wait_times_out_unset_and_close_gives_the_signals_back():
    before = [signal.getsignal(sig) for sig in STOP_SIGNALS]
    with StopSignal() as stop:
        assert [signal.getsignal(sig) for sig in STOP_SIGNALS] != before
        assert stop.wait(0.05) is False and not stop.stopped
    assert [signal.getsignal(sig) for sig in STOP_SIGNALS] == before
