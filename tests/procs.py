"""Process bookkeeping for tests: find what the suite started (stopping is atoll.client.local.stop_processes)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from atoll.errors import ControllerUnavailable


def children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        # the command name may contain spaces and parentheses: the ppid follows the last ')'
        fields = text[text.rindex(")") + 2 :].split()
        if fields[0] == "Z":  # a zombie is already dead; its parent just has not reaped it
            continue
        kids.setdefault(int(fields[1]), []).append(int(text.split(" ", 1)[0]))
    return kids


def descendants(pid: int) -> list[int]:
    kids, out, todo = children_map(), [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def rss(pid: int) -> int:
    """Resident memory of a process, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie answers kill(0) but is dead
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def wait_for_file(path: Path, proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    """The contents of a daemon's ready file, failing early if the daemon exits first."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"{proc.args} exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"{path} not written in {timeout_s}s"
        time.sleep(0.05)
    return path.read_text().strip()


def live_workers(client, count: int, timeout_s: float = 30.0) -> dict[str, int]:
    """id -> pid of the live workers once ``count`` are (status asked again until then); every
    listed worker id appears once. Right after a controller restarts, a client's channel may still
    be waiting out its reconnect backoff (up to 2 s, atoll.net.rpc) and fail a call at once: asked
    again too, until the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            listed = client.status().workers
        except ControllerUnavailable:
            assert time.monotonic() < deadline, "the controller stayed unreachable"
            time.sleep(0.2)
            continue
        live = {w.worker_id: w.pid for w in listed if w.alive}
        if len(live) == count:
            assert len({w.worker_id for w in listed}) == len(listed), listed
            return live
        assert time.monotonic() < deadline, listed
        time.sleep(0.2)


def health(channel: grpc.Channel) -> int:
    """grpc_health_probe's question (grpc.health.v1 Check, no token) over ``channel``."""
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


@contextlib.contextmanager
def in_process_cluster(tmp_path: Path):
    """A controller and one worker in this process (one profiler, one debugger sees both):
    yields (controller, worker, token_file); stops both."""
    from atoll.controller.daemon import ControllerConfig, ControllerDaemon
    from atoll.net.auth import resolve_token
    from atoll.worker.daemon import WorkerDaemon

    token_file = str(tmp_path / "token")
    controller = ControllerDaemon(ControllerConfig(token_file=token_file))
    controller.start()
    worker = WorkerDaemon(controller=controller.address, token=resolve_token(token_file=token_file))
    try:
        worker.start()
        yield controller, worker, token_file
    finally:
        worker.stop()
        controller.stop()
