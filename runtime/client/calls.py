"""A job's step calls as the client sends them, and sends them again when the controller could
not be reached: a controller restarted on its state directory takes its jobs back
(controller/recovery.py), and the steps it never answered are sent again, marked ``retry``, in
their order; workers answer a step they already ran from their ledger (atoll.worker.ledger), so
none runs twice. Past ``reconnect_timeout_s`` the step raises ControllerUnavailable."""

from __future__ import annotations

import threading
import time

from atoll.errors import ControllerUnavailable
from atoll.net.rpc import Endpoint, unreachable

RESEND_EVERY_S = 0.25
"""How often unanswered steps go out again while the controller cannot be reached."""


class StepCall:
    """One Step or Steps call: its request, and the gRPC future of its latest sending."""

    def __init__(self, endpoint: Endpoint, method: str, request, timeout_s: float, wait: bool = False):
        """``wait``: the caller waits for the reply at once: the call is made in its thread and
        returns when answered (``Endpoint.settled``); a sending again never waits."""
        self.method, self.request = method, request
        self._endpoint, self._timeout_s = endpoint, timeout_s
        self._lock = threading.Lock()
        self.future = (endpoint.settled if wait else endpoint.future)(method, request, timeout_s)
        self.unreachable_since: float | None = None

    @property
    def steps(self) -> list:
        return list(self.request.steps) if self.method == "Steps" else [self.request]

    def lost(self) -> bool:
        """Whether its latest sending ended without reaching the controller."""
        if not self.future.done() or self.future.cancelled():
            return False
        return unreachable(self.future.exception())

    def done(self) -> bool:
        """Answered, or failed for good (a lost sending is not done: it is sent again)."""
        return self.future.done() and not self.lost()

    def wait(self) -> None:
        """Until its latest sending ends (its reply or error goes to its own caller)."""
        try:
            self.future.exception()
        except Exception:  # noqa: BLE001 (cancelled, or the channel closed)
            pass

    def send_again(self) -> None:
        with self._lock:
            if self.lost():
                for step in self.steps:
                    step.retry = True
                self.future = self._endpoint.future(self.method, self.request, self._timeout_s)

    def reply(self, timeout_s: float | None, reconnect_timeout_s: float, send_lost) -> object:
        """The call's reply; while the controller cannot be reached, ``send_lost()`` sends this
        job's lost calls again, in order, for up to ``reconnect_timeout_s``."""
        while True:
            try:
                return self._endpoint.resolve(self.future, self.method, timeout_s)
            except ControllerUnavailable as e:
                now = time.monotonic()
                self.unreachable_since = self.unreachable_since or now
                if now - self.unreachable_since > reconnect_timeout_s:
                    numbers = ", ".join(str(s.seq) for s in self.steps)
                    raise ControllerUnavailable(
                        f"{e}; sent again for {reconnect_timeout_s:g} s without an answer, "
                        f"step(s) {numbers} may or may not have run"
                    ) from None
                time.sleep(RESEND_EVERY_S)
                send_lost()
