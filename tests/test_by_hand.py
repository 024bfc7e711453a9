"""The by-hand workflow: `atoll controller`, two `atoll worker`s and a client script, each its own
process, train a 2-stage model; `atoll status` lists the workers and the job."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from atoll.cli.malloc import DAEMON_MALLOC
from atoll.client.local import stop_processes as stop
from tests.procs import live_workers, wait_for_file

pytestmark = pytest.mark.cluster  # every test here starts processes

ROOT = Path(__file__).resolve().parent.parent
ATOLL = [sys.executable, "-m", "atoll.cli"]

CLIENT_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.nn as nn, torch.nn.functional as F
    import atoll
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    client = atoll.connect(sys.argv[1], token_file=sys.argv[2])
    job = client.pipeline(model, example_input=x, example_target=y, loss_fn=F.mse_loss, stages=2,
                          microbatches=2, optimizer="sgd", optimizer_args={"lr": 0.1}, name="by-hand")
    losses = [job.step(x, y) for _ in range(5)]
    print("losses", " ".join(f"{l:.5f}" for l in losses))
    print("job", job.id)
""")


@pytest.fixture()
def daemons(tmp_path):
    procs: list[subprocess.Popen] = []
    yield procs
    stop(procs)


def test_controller_two_workers_and_a_client_script(tmp_path, daemons):
    token = tmp_path / "token"  # created by the controller
    logs = [open(tmp_path / f"{n}.log", "w") for n in ("controller", "worker0", "worker1")]
    daemons.append(
        subprocess.Popen(
            [
                *ATOLL,
                "controller",
                "--port",
                "0",
                "--token-file",
                str(token),
                "--ready-file",
                str(tmp_path / "c.ready"),
            ],
            stdout=logs[0],
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"},
        )
    )
    address = wait_for_file(tmp_path / "c.ready", daemons[0])
    assert f"listening on {address}" in (tmp_path / "controller.log").read_text()
    assert token.stat().st_mode & 0o777 == 0o600
    for i in range(2):
        daemons.append(
            subprocess.Popen(
                [
                    *ATOLL,
                    "worker",
                    "--controller",
                    address,
                    "--device",
                    "cpu",
                    "--token-file",
                    str(token),
                    "--ready-file",
                    str(tmp_path / f"w{i}.ready"),
                ],
                stdout=logs[1 + i],
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"} if i else None,
            )
        )
    for i in range(2):
        wait_for_file(tmp_path / f"w{i}.ready", daemons[1 + i])
    # each daemon re-executed itself once (same PID) with the daemons' malloc settings, a setting
    # the caller chose kept (ld.so cuts GLIBC_TUNABLES at its colons in place: read each alone)
    for p in daemons:
        environ = Path(f"/proc/{p.pid}/environ").read_bytes()
        assert all(f"{name}=".encode() in environ for name in DAEMON_MALLOC), (p.args, environ)
    assert b"glibc.malloc.hugetlb=0" in Path(f"/proc/{daemons[2].pid}/environ").read_bytes()

    client = subprocess.run(
        [sys.executable, "-c", CLIENT_SCRIPT, address, str(token)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert client.returncode == 0, client.stderr[-3000:]
    losses = [float(v) for v in client.stdout.split("losses", 1)[1].splitlines()[0].split()]
    assert len(losses) == 5 and losses[-1] < losses[0]
    job_id = client.stdout.split("job", 1)[1].split()[0]

    status = subprocess.run(
        [*ATOLL, "status", "--controller", address, "--token-file", str(token)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    assert "workers (2 alive)" in status.stdout
    assert status.stdout.count(" alive ") == 2
    assert job_id in status.stdout and "by-hand" in status.stdout and "steps=5" in status.stdout


def test_worker_registers_again_with_a_restarted_controller(tmp_path, daemons, record_property):
    import torch
    import torch.nn.functional as F
    from torch import nn

    import atoll

    token = tmp_path / "token"

    def start_controller(port: int, name: str) -> str:
        ready = tmp_path / f"{name}.ready"
        daemons.append(
            subprocess.Popen(
                [
                    *ATOLL,
                    "controller",
                    "--port",
                    str(port),
                    "--token-file",
                    str(token),
                    "--ready-file",
                    str(ready),
                    "--heartbeat-timeout",
                    "3",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        )
        return wait_for_file(ready, daemons[-1])

    address = start_controller(0, "first")
    daemons.append(
        subprocess.Popen(
            [
                *ATOLL,
                "worker",
                "--controller",
                address,
                "--token-file",
                str(token),
                "--ready-file",
                str(tmp_path / "w.ready"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    )
    wait_for_file(tmp_path / "w.ready", daemons[-1])
    first = daemons.pop(0)
    stop([first])
    assert first.returncode is not None

    port = int(address.rsplit(":", 1)[1])  # the same address the worker knows
    start_controller(port, "second")
    client = atoll.connect(address, token_file=str(token))
    restarted = time.monotonic()
    deadline = restarted + 30
    while not any(w.alive for w in client.status().workers):
        assert time.monotonic() < deadline, "the worker did not register with the new controller"
        time.sleep(0.2)
    record_property("registered_again_after_s", time.monotonic() - restarted)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    job = client.pipeline(
        model,
        example_input=x,
        example_target=y,
        loss_fn=F.mse_loss,
        stages=1,
        microbatches=2,
        optimizer="sgd",
        optimizer_args={"lr": 0.1},
    )
    losses = [job.step(x, y) for _ in range(3)]
    assert losses[-1] < losses[0]
    job.close()
    client.close()


def test_a_restarted_controller_knows_each_worker_once_and_a_killed_one_as_dead(tmp_path, daemons):
    """Issue 25's identity case, by hand: worker X (w0) is frozen while its controller is killed and
    restarted on the same port, and a new worker Y registers first and gets w0. When X wakes, its
    heartbeat carries the old controller's key, so the new one does not take it for w0: X registers
    again as w1. Y killed is reported dead once the heartbeat timeout passes (X's heartbeats no longer
    keep "w0" alive), and a second restart gives X its id back."""
    import signal

    import atoll

    token = tmp_path / "token"
    port = 0

    def start(name: str, *args: str) -> str:
        ready = tmp_path / f"{name}.ready"
        cmd = [*ATOLL, *args, "--token-file", str(token), "--ready-file", str(ready)]
        daemons.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=ROOT))
        return wait_for_file(ready, daemons[-1])

    def controller(name: str) -> tuple[subprocess.Popen, str]:
        address = start(name, "controller", "--port", str(port), "--heartbeat-timeout", "3")
        return daemons[-1], address

    def workers(address: str, alive: int) -> dict[str, int]:
        """id -> pid of the live workers, once ``alive`` are; every id listed once."""
        with atoll.connect(address, token_file=str(token)) as client:
            return live_workers(client, alive)

    first, address = controller("first")
    port = int(address.rsplit(":", 1)[1])
    start("x", "worker", "--controller", address)
    x = daemons[-1]
    assert workers(address, 1) == {"w0": x.pid}

    x.send_signal(signal.SIGSTOP)
    try:
        first.kill()
        first.wait(10)
        second, _ = controller("second")
        start("y", "worker", "--controller", address)
        y = daemons[-1]
        assert workers(address, 1) == {"w0": y.pid}  # the new controller counts from w0
    finally:
        x.send_signal(signal.SIGCONT)
    assert workers(address, 2) == {"w0": y.pid, "w1": x.pid}

    y.kill()
    y.wait(10)
    killed = time.monotonic()
    assert workers(address, 1) == {"w1": x.pid}
    assert time.monotonic() - killed < 3 + 7  # the heartbeat timeout, with room for a loaded machine

    second.kill()
    second.wait(10)
    controller("third")
    assert workers(address, 1) == {"w1": x.pid}  # registering again, x keeps its id
