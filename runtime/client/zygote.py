"""The LocalCluster's end of the zygote (atoll.cli.zygote): start it, ask it for daemons, and hold
each daemon as a ``subprocess.Popen``-like handle (pid, poll, wait, send_signal, kill)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path


class ZygoteError(RuntimeError):
    """The zygote did not start, or could not fork a daemon."""


STATUS_LOST = -255
"""The return code of a daemon that ended after its zygote was killed: its exit status is lost."""


class ForkedProcess:
    """A daemon forked by the zygote: the subset of ``subprocess.Popen`` a LocalCluster and its
    users need. Its exit status comes from the zygote, which is its parent and reaps it."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]):
        self._zygote = zygote
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._zygote.pump(0.0)
        if self.returncode is None and self._zygote.gone and not os.path.exists(f"/proc/{self.pid}"):
            self.returncode = STATUS_LOST
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._zygote.pump(0.5 if left is None else min(left, 0.5))
            self.poll()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # ended between the poll and the kill; the zygote will say so
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """One ``python -m atoll.cli.zygote`` process; ``spawn`` forks a daemon from it. ``close``
    ends the zygote (after its daemons are stopped: a daemon still running then loses its exit
    status, not its life)."""

    def __init__(self, stderr, env: dict[str, str], timeout_s: float):
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "atoll.cli.zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
        )
        self._buffer = b""
        self._children: dict[int, ForkedProcess] = {}
        self._exited: dict[int, int] = {}  # exits heard before their spawn answer was read
        self._answers: list[dict] = []
        self._lock = threading.Lock()  # one reader of the zygote's output at a time
        self._spawning = threading.Lock()  # one request and its answer at a time (a shared zygote)
        self.gone = False
        """The zygote's output ended: it exited or was killed."""
        self._read_answer(timeout_s, "ready")

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def running(self) -> bool:
        return not self.gone and self._proc.poll() is None

    def spawn(self, argv: list[str], log: str, env: dict[str, str], timeout_s: float = 30.0) -> ForkedProcess:
        request = json.dumps({"argv": argv, "log": log, "env": env}) + "\n"
        with self._spawning:
            try:
                self._proc.stdin.write(request.encode())
                self._proc.stdin.flush()
            except BrokenPipeError:
                raise ZygoteError(f"the zygote (pid {self.pid}) is gone: exit code {self._proc.poll()}") from None
            answer = self._read_answer(timeout_s, "started")
        child = ForkedProcess(self, answer["started"], ["atoll", *argv])
        self._children[child.pid] = child
        if child.pid in self._exited:
            child.returncode = self._exited.pop(child.pid)
        return child

    def _read_answer(self, timeout_s: float, key: str) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self._answers:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ZygoteError(f"no answer from the zygote (pid {self.pid}) within {timeout_s}s")
            if not self.pump(min(left, 0.5)) and self.gone:
                raise ZygoteError(f"the zygote (pid {self.pid}) exited with code {self._proc.wait(10)}")
        answer = self._answers.pop(0)
        if key not in answer:
            raise ZygoteError(f"the zygote answered {answer}")
        return answer

    def pump(self, timeout_s: float) -> bool:
        """Read what the zygote said within ``timeout_s``; False if it said nothing."""
        with self._lock:
            return self._read(timeout_s)

    def _read(self, timeout_s: float) -> bool:
        out = self._proc.stdout.fileno()
        if self.gone or not select.select([out], [], [], timeout_s)[0]:
            if self.gone:
                time.sleep(min(timeout_s, 0.05))
            return False
        data = os.read(out, 65536)
        if not data:
            self.gone = True
            return False
        self._buffer += data
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            message = json.loads(line)
            if "exited" in message:
                child = self._children.pop(message["exited"], None)
                if child is None:
                    self._exited[message["exited"]] = message["code"]
                else:
                    child.returncode = message["code"]
            else:
                self._answers.append(message)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        if self._proc.stdin and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        self._proc.stdout.close()


class _Shared:
    """The zygotes of one ``shared`` block, by start environment."""

    def __init__(self, log_dir: Path, ignore: frozenset[str]):
        self.log_dir = log_dir
        self.ignore = ignore
        self.zygotes: dict[tuple, Zygote] = {}
        self.started = itertools.count()  # numbers the zygotes' logs


_blocks: list[_Shared | None] = []
"""The open ``shared`` blocks, innermost last (None: an ``unshared`` block)."""
_blocks_lock = threading.Lock()


@contextlib.contextmanager
def shared(log_dir: str | os.PathLike, ignore: Iterable[str] = ()):
    """Within this block, the LocalClusters this process starts fork their daemons from one zygote
    per start environment (started by the first such cluster, closed when the block ends) instead
    of each starting and closing its own; the zygotes log to ``log_dir``. A zygote costs about
    4.6 s of CPU here (importing torch, atoll and atoll.cli.zygote's warm imports): a process that
    starts many clusters, as the test suite does, pays it once. The environment is the key because
    the daemons run with what their zygote started with (its malloc settings, torch's); the
    variables named in ``ignore`` are left out of it (each daemon still gets its cluster's value:
    a fork takes its environment from the request)."""
    block = _Shared(Path(log_dir), frozenset(ignore))
    _blocks.append(block)
    try:
        yield
    finally:
        with _blocks_lock:
            _blocks.remove(block)
            for zygote in block.zygotes.values():
                zygote.close()


@contextlib.contextmanager
def unshared():
    """Within this block, each LocalCluster starts and closes a zygote of its own again."""
    _blocks.append(None)
    try:
        yield
    finally:
        _blocks.pop()


def zygote_for(env: dict[str, str], log_dir: Path, timeout_s: float) -> tuple[Zygote, bool]:
    """A zygote for a cluster whose daemons run with ``env``, and whether the cluster owns it (and
    so closes it): one of its own, logging to ``log_dir``/zygote.log, unless a ``shared`` block is
    open."""
    block = _blocks[-1] if _blocks else None
    if block is None:  # (the zygote holds its own copy of its log's descriptor)
        with open(log_dir / "zygote.log", "w") as log:
            return Zygote(log, env, timeout_s), True
    key = tuple(sorted((k, v) for k, v in env.items() if k not in block.ignore))
    with _blocks_lock:
        zygote = block.zygotes.get(key)
        if zygote is None or not zygote.running:
            if zygote is not None:
                zygote.close()
            with open(block.log_dir / f"zygote-{next(block.started)}.log", "w") as log:
                zygote = block.zygotes[key] = Zygote(log, env, timeout_s)
        return zygote, False
