"""Operating the daemons: health probes without the token, clean stops on SIGTERM and Ctrl-C (exit
0, port freed, a stopping worker deregistered at once), one-line CLI errors, `atoll status --json`
and `--watch`, and the environment variables every command honours."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

import atoll
from atoll.cli import commands as cli
from atoll.client.local import stop_processes
from atoll.net.rpc import _check_free
from tests import models
from tests.procs import health, wait_for_file

pytestmark = pytest.mark.cluster  # every test here starts processes

ROOT = Path(__file__).resolve().parent.parent
ATOLL = [sys.executable, "-m", "atoll.cli"]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _env(**extra: str) -> dict:
    """This environment without atoll's variables (a developer's shell may set them), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATOLL_")}
    return {**env, **extra}


def _health(address: str) -> int:
    """grpc_health_probe's question, from a plain channel with no token."""
    with grpc.insecure_channel(address) as channel:
        return health(channel)


def _wait_health(address: str, want: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (got := _health(address)) != want:
        assert time.monotonic() < deadline, f"{address} answers {got}, not {want}, after {timeout_s}s"
        time.sleep(0.1)


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _assert_port_free(port: int) -> None:
    """Raises while any process still listens on ``port``: the daemons' own check before they bind
    (SO_REUSEADDR, as gRPC binds), so the stopped daemon's side of a connection its live peer has
    not closed yet (FIN_WAIT/TIME_WAIT) does not count. A plain bind refuses those, and failed in
    CI when the controller was stopped under a live worker."""
    _check_free("127.0.0.1", port)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen, sig: int, timeout_s: float = 20.0) -> int:
    proc.send_signal(sig)
    return proc.wait(timeout_s)


@pytest.fixture()
def daemons():
    procs: list[subprocess.Popen] = []
    yield procs
    stop_processes(procs)  # whatever a failed test left running, by PID


def _start(daemons: list, tmp_path: Path, name: str, *args: str) -> tuple[subprocess.Popen, str]:
    ready = tmp_path / f"{name}.ready"
    ready.unlink(missing_ok=True)
    log = open(tmp_path / f"{name}.log", "a")
    proc = subprocess.Popen(
        [*ATOLL, *args, "--ready-file", str(ready), "--exit-with-parent", str(os.getpid())],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=_env(),
        cwd=ROOT,
    )
    log.close()
    daemons.append(proc)
    return proc, wait_for_file(ready, proc).splitlines()[0]


@pytest.mark.timeout(180)
def test_health_stops_and_deregistration(tmp_path, daemons, record_property):
    """Health answers without the token on both daemons; a worker reports NOT_SERVING while its
    controller is gone and SERVING again once one answers at the same address; SIGTERM and
    SIGINT end each daemon with exit code 0 and free its port; a stopped worker leaves the
    registry at once, long before the (60 s) heartbeat timeout."""
    token = tmp_path / "token"
    common = ["--token-file", str(token)]
    controller_args = ["controller", "--heartbeat-timeout", "60", "--heartbeat-interval", "0.2", *common]
    controller, address = _start(daemons, tmp_path, "controller", *controller_args)
    assert _health(address) == SERVING
    worker, worker_address = _start(daemons, tmp_path, "w0", "worker", "--controller", address, *common)
    _wait_health(worker_address, SERVING)
    with atoll.connect(address, token_file=str(token)) as client:
        (registered,) = client.status().workers
        assert registered.alive and registered.address == worker_address

        # a stopping worker deregisters: gone from status at once, not after 60 s of silence
        started = time.monotonic()
        assert _stop(worker, signal.SIGTERM) == 0
        _assert_port_free(_port(worker_address))
        while any(w.alive for w in client.status().workers):
            assert time.monotonic() - started < 10, client.status().render()
            time.sleep(0.1)
        record_property("deregistered_after_s", time.monotonic() - started)
        assert registered.worker_id not in {w.worker_id for w in client.status().workers}

    worker, worker_address = _start(daemons, tmp_path, "w1", "worker", "--controller", address, *common)
    _wait_health(worker_address, SERVING)
    assert _stop(controller, signal.SIGTERM) == 0
    _assert_port_free(_port(address))
    _wait_health(worker_address, NOT_SERVING)  # its heartbeats fail: the controller is gone

    # a controller at the same address: the worker registers again and is SERVING again
    _start(daemons, tmp_path, "controller", *controller_args, "--port", str(_port(address)))
    _wait_health(worker_address, SERVING)
    assert _stop(worker, signal.SIGINT) == 0  # Ctrl-C
    _assert_port_free(_port(worker_address))
    assert _stop(daemons[-1], signal.SIGINT) == 0
    _assert_port_free(_port(address))


def _run(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*ATOLL, *args], capture_output=True, text=True, timeout=timeout, env=env or _env(), cwd=ROOT)


USER_ERRORS = (
    "missing-model-file",
    "unknown-log-level",
    "cuda-on-a-cpu-build",
    "controller-unreachable",
    "no-build-function",
    "no-controller-address",
)


def _user_errors(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """Per case: the command line, and the one line it must print."""
    no_build = tmp_path / "no_build.py"
    no_build.write_text("x = 1\n")
    token = tmp_path / "token"
    token.write_text("t" * 64 + "\n")
    return {
        "missing-model-file": (["plan", "/nonexistent.py"], r"atoll plan: /nonexistent.py: no such file"),
        "unknown-log-level": (
            ["controller", "--log-level", "foo"],
            r"atoll controller: argument --log-level: invalid choice: 'FOO'",
        ),
        "cuda-on-a-cpu-build": (
            ["worker", "--device", "cuda:0", "--controller", "127.0.0.1:1", "--token-file", str(token)],
            r"atoll worker: device cuda:0: (this torch build has no CUDA|no CUDA device is visible)",
        ),
        "controller-unreachable": (
            ["status", "--controller", f"127.0.0.1:{_closed_port()}", "--token-file", str(token)],
            r"atoll status: no controller answered at 127\.0\.0\.1:\d+: controller unreachable",
        ),
        "no-build-function": (["plan", str(no_build)], r"atoll plan: .*no_build\.py defines no build\(\)"),
        "no-controller-address": (["status", "--token-file", str(token)], r"atoll status: no controller address"),
    }


@pytest.mark.timeout(300)
def test_a_user_error_is_one_line_and_a_nonzero_exit(tmp_path):
    """Each case as a user types it (all at once: each process spends its time importing torch)."""
    cases = _user_errors(tmp_path)
    assert set(cases) == set(USER_ERRORS)
    if torch.cuda.is_available():
        del cases["cuda-on-a-cpu-build"]
    cases["debug-shows-the-traceback"] = (["plan", "/nonexistent.py", "--log-level", "debug"], "")
    procs = {
        case: subprocess.Popen(
            [*ATOLL, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT
        )
        for case, (args, _) in cases.items()
    }
    try:
        results = {case: (*p.communicate(timeout=120), p.returncode) for case, p in procs.items()}
    finally:
        stop_processes(list(procs.values()))
    for case, (out, err, code) in results.items():
        assert code != 0, (case, out, err)
        lines = err.splitlines()
        if case == "debug-shows-the-traceback":
            assert code == 1 and "Traceback" in err and lines[-1] == "atoll plan: /nonexistent.py: no such file", err
            continue
        assert len(lines) == 1 and re.match(cases[case][1], lines[0]), (case, err)
        assert code == (2 if case == "unknown-log-level" else 1), (case, code)


def test_version_help_and_the_schedules_offered():
    from importlib.metadata import version

    from atoll.core.names import SCHEDULES

    assert cli.SCHEDULES == SCHEDULES
    parser = cli.build_parser()
    with pytest.raises(SystemExit) as done:
        parser.parse_args(["--version"])
    assert done.value.code == 0
    # every option of every command has help text
    commands = parser._subparsers._group_actions[0].choices
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.help, f"atoll {name} {action.option_strings or action.dest} has no help"
    assert version("atoll")


@pytest.fixture(scope="module")
def stepped():
    """One cluster of 2 workers and a 2-stage job stepped once."""
    with atoll.LocalCluster(workers=2) as cluster, cluster.client() as client:
        job, _, batches, _ = models.submit(client, stages=2, microbatches=2, name="ops")
        loss = job.step(*batches[0])
        yield cluster, job, loss
        job.close()


def _status_env(cluster) -> dict:
    return _env(ATOLL_CONTROLLER=cluster.address, ATOLL_TOKEN_FILE=str(cluster.log_dir / "token"))


@pytest.mark.timeout(180)
def test_status_json_lists_islands_workers_and_jobs(stepped):
    cluster, job, loss = stepped
    deadline = time.monotonic() + 20
    while True:  # memory arrives with the workers' heartbeats (one a second)
        run = _run("status", "--json", "--controller", cluster.address, "--token-file", str(cluster.log_dir / "token"))
        assert run.returncode == 0, run.stderr
        status = json.loads(run.stdout)
        if all(w["rss_bytes"] > 0 for w in status["workers"]) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert set(status) == {"islands", "workers", "jobs", "queue"}
    (island,) = status["islands"]
    assert island["alive"] == 2 and len(island["workers"]) == 2 and island["devices"] == ["cpu"]
    assert len(status["workers"]) == 2
    for w in status["workers"]:
        assert w["alive"] and w["device"] == "cpu" and w["island"] == island["name"] and w["jobs"] == [job.id]
        assert 10 * 2**20 < w["rss_bytes"] < 64 * 2**30  # a torch process: tens of MiB at least
    (shown,) = status["jobs"]
    assert shown["job_id"] == job.id and shown["name"] == "ops" and shown["state"] == "ready"
    assert shown["steps"] == 1 and shown["steps_per_s"] > 0
    assert shown["last_loss"] == pytest.approx(loss)
    assert shown["predicted_peak_bytes"] > 0 and shown["measured_peak_bytes"] > 0
    assert status["queue"] == []


def _exit_code(proc: subprocess.Popen, timeout_s: float):
    """``proc``'s exit code, or, if it is still running after ``timeout_s``, what its stacks were then
    (it runs under ``-X faulthandler``, which prints them to stderr on SIGABRT)."""
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        proc.wait(10)
        return f"still running {timeout_s}s after Ctrl-C; its threads then:"


@pytest.mark.timeout(180)
def test_status_watch_and_the_environment(stepped, monkeypatch):
    """$ATOLL_CONTROLLER and $ATOLL_TOKEN_FILE stand in for --controller and --token-file, in the
    CLI and in atoll.connect(); --watch re-renders until Ctrl-C, then exits 0."""
    cluster, job, _ = stepped
    proc = subprocess.Popen(  # -X faulthandler: a hung command prints its threads' stacks on SIGABRT
        [sys.executable, "-X", "faulthandler", *ATOLL[1:], "status", "--watch", "0.2", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_status_env(cluster),
        cwd=ROOT,
    )
    try:
        first, second = json.loads(proc.stdout.readline()), json.loads(proc.stdout.readline())
        assert [j["job_id"] for j in first["jobs"]] == [j["job_id"] for j in second["jobs"]] == [job.id]
        proc.send_signal(signal.SIGINT)
        assert _exit_code(proc, 20) == 0, proc.stderr.read()
    finally:
        stop_processes([proc])
        proc.stdout.close()
        proc.stderr.close()
    run = _run("status", env=_status_env(cluster))
    assert run.returncode == 0, run.stderr
    assert f"  {job.id} " in run.stdout and "loss=" in run.stdout and "islands (1):" in run.stdout

    monkeypatch.setenv("ATOLL_CONTROLLER", cluster.address)
    with atoll.connect(token=cluster.token) as client:
        assert [j.job_id for j in client.status().jobs] == [job.id]
    monkeypatch.delenv("ATOLL_CONTROLLER")
    with pytest.raises(atoll.InvalidInput, match="ATOLL_CONTROLLER"):
        atoll.connect(token=cluster.token)


def test_log_records_carry_worker_job_and_step(capsys):
    import logging

    from atoll.net import log as _log

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    _log.configure("INFO")
    try:
        _log.set_worker("w7")
        with _log.context("job3", 12):
            logging.getLogger("atoll.test").info("inside")
        logging.getLogger("atoll.test").info("outside")
    finally:
        _log.set_worker("")
        root.handlers[:] = handlers
        root.setLevel(level)
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith("INFO atoll.test [worker=w7 job=job3 step=12] inside"), err
    assert err[1].endswith("INFO atoll.test [worker=w7 job=- step=-] outside"), err


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_daemons_on_an_ipv6_host_write_it_in_brackets(tmp_path):
    """``--host ::1``: every address a daemon reports is ``[::1]:port`` (what gRPC targets and the
    value servers' peers read), and a job, a remote value and status work through them."""
    from atoll.controller.daemon import ControllerConfig, ControllerDaemon
    from atoll.net.auth import resolve_token
    from atoll.worker.daemon import WorkerDaemon

    token_file = str(tmp_path / "token")
    controller = ControllerDaemon(ControllerConfig(host="::1", token_file=token_file))
    controller.start()
    worker = WorkerDaemon(controller=controller.address, token=resolve_token(token_file=token_file), host="::1")
    try:
        worker.start()
        assert re.fullmatch(r"\[::1\]:\d+", controller.address) and re.fullmatch(r"\[::1\]:\d+", worker.address)
        model, batches, loss_fn = models.mlp()
        x, y = batches[0]
        with atoll.connect(controller.address, token_file=token_file) as client:
            job = client.pipeline(model, example_input=x, example_target=y, loss_fn=loss_fn, stages=1, microbatches=2)
            target = client.put(y)
            assert torch.equal(target.result(), y)
            assert job.step(x, target) > 0
            job.close()
            (listed,) = client.status().workers
            assert listed.address == worker.address and listed.alive
    finally:
        worker.stop()
        controller.stop()
