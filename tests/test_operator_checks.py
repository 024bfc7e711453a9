"""What an operator meets before any cluster runs (no daemons started): addresses without a port
refused, checkpoint files the owner's alone, nothing written by a controller that could not bind,
status that forgets the dead after a grace period, commands that do not import torch."""

import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import atoll
from atoll._rpc import atoll_pb2 as pb
from atoll.controller.daemon import ControllerConfig, ControllerDaemon
from atoll.controller.jobs import Job
from atoll.controller.service import ControllerService
from atoll.core import checkpoint
from atoll.net import address as _address
from tests.models import compile_locally

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("address", ["127.0.0.1", "localhost:", "host:http", "::1:7000", "[::1]", ":7000", "h:70000"])
def test_an_address_without_a_port_is_refused_with_the_expected_form(address):
    with pytest.raises(atoll.InvalidInput, match=r"is not HOST:PORT \(e.g. 127.0.0.1:7000"):
        atoll.connect(address, token="t")


def test_well_formed_addresses_pass():
    for address in ("127.0.0.1:7000", "localhost:1", "[::1]:50051", "node-3.cluster:65535"):
        assert _address.checked(address, "address") == address


@pytest.mark.cluster
def test_the_cli_refuses_a_controller_without_a_port_in_one_line():
    run = subprocess.run(
        [sys.executable, "-m", "atoll.cli", "status", "--controller", "127.0.0.1", "--token-file", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [
        "atoll status: controller address '127.0.0.1' is not HOST:PORT (e.g. 127.0.0.1:7000, or [::1]:7000)"
    ]


def test_checkpoints_are_the_owners_alone(tmp_path):
    root = tmp_path / "ckpt"
    version = checkpoint.new_version(root, step=3)
    checkpoint.write_tensors(version, checkpoint.worker_file(0, 0), {"param/w": torch.ones(2)})
    checkpoint.commit(version, {"step": 3})
    for directory in (root, version):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    for file in (*version.iterdir(), root / "current"):
        assert stat.S_IMODE(file.stat().st_mode) == 0o600, file


def test_a_controller_that_cannot_bind_writes_no_token_file(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    token_file = tmp_path / "token"
    try:
        with pytest.raises(atoll.WorkerUnavailable, match="could not bind|in use"):
            ControllerDaemon(ControllerConfig(port=taken.getsockname()[1], token_file=str(token_file)))
    finally:
        taken.close()
    assert not token_file.exists()
    daemon = ControllerDaemon(ControllerConfig(token_file=str(token_file)))  # once bound, it is written
    try:
        assert token_file.read_text().strip() and stat.S_IMODE(token_file.stat().st_mode) == 0o600
    finally:
        daemon.stop()


def _tiny_job(job_id: str) -> Job:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    compiled = compile_locally(model, torch.randn(4, 4), torch.randn(4, 2), F.mse_loss, stages=1, microbatches=2)
    return Job(job_id, job_id, compiled, [], {})


def test_status_leaves_out_the_long_dead_and_the_long_failed_unless_asked_for_all():
    service = ControllerService(token="t", status_grace_s=60.0)
    try:
        now = time.monotonic()
        workers = {}
        for name in ("alive", "just-dead", "long-dead"):
            workers[name] = service.registry.register(
                pb.RegisterWorkerRequest(address=f"127.0.0.1:{len(workers) + 1}", device="cpu", host=name)
            )
        for name in ("just-dead", "long-dead"):
            service.registry.mark_dead(workers[name], "test")
        workers["long-dead"].died_at = now - 61
        jobs = {name: _tiny_job(name) for name in ("ready", "just-failed", "long-failed", "long-failed-too")}
        for name in ("just-failed", "long-failed", "long-failed-too"):
            jobs[name].fail("test")
        jobs["long-failed"].failed_at = jobs["long-failed-too"].failed_at = now - 61
        with service.jobs.lock:
            for job in jobs.values():
                service.jobs.add(job)

        def shown(all: bool) -> tuple[set, set]:
            reply = service.Status(pb.StatusRequest(all=all), None)
            return {w.host for w in reply.workers}, {j.job_id for j in reply.jobs}

        assert shown(all=False) == ({"alive", "just-dead"}, {"ready", "just-failed"})
        assert shown(all=True) == ({"alive", "just-dead", "long-dead"}, set(jobs))
    finally:
        service.stop()


@pytest.mark.cluster
def test_atoll_and_its_status_command_do_not_import_torch():
    """`import atoll` resolves its public names on first use, and `atoll status` talks to the
    controller without torch (bench/cli.py measures both commands' time)."""
    code = (
        "import sys, atoll, atoll.cli.commands, atoll.client.connection\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert callable(atoll.connect) and 'torch' in sys.modules\n"  # the client itself needs it
        "assert sorted(atoll.__all__) == sorted(atoll._EXPORTS) and all(getattr(atoll, n) for n in atoll.__all__)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATOLL_")}
    code = "import sys, runpy; sys.argv = ['atoll', 'status', '--help']\ntry:\n    runpy.run_module('atoll.cli.commands', run_name='__main__')\nexcept SystemExit:\n    pass\nassert 'torch' not in sys.modules\n"  # noqa: E501
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert run.returncode == 0 and "--all" in run.stdout, run.stderr
