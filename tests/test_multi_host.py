"""The README's several-hosts recipe, on hosts made of network namespaces joined by a bridge:
the controller on one, a worker on each of two others, the client outside them all.

Needs root and iproute2; it skips where the namespaces cannot be created.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import atoll
from atoll.client.local import stop_processes
from tests.procs import wait_for_file

pytestmark = pytest.mark.cluster  # every test here starts processes

ROOT = Path(__file__).resolve().parent.parent
PREFIX = f"at{os.getpid() % 100000}"  # unique per test run: namespaces are system-wide
BRIDGE, SUBNET = f"{PREFIX}br", "10.77.{}.{}"


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


@pytest.fixture()
def hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    octet = os.getpid() % 200 + 20
    created: list[str] = []
    try:
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", SUBNET.format(octet, 254) + "/24", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")
        for i in (1, 2, 3):
            ns = f"{PREFIX}h{i}"
            sh("ip", "netns", "add", ns)
            created.append(ns)
            sh("ip", "link", "add", f"{PREFIX}v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "link", "set", f"{PREFIX}v{i}", "master", BRIDGE)
            sh("ip", "link", "set", f"{PREFIX}v{i}", "up")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", SUBNET.format(octet, i) + "/24", "dev", "eth0")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as e:
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {e}")
    procs: list[subprocess.Popen] = []
    try:
        yield [(f"{PREFIX}h{i}", SUBNET.format(octet, i)) for i in (1, 2, 3)], procs
    finally:
        stop_processes(procs)
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, timeout=30)


def test_controller_and_workers_on_three_hosts(hosts, tmp_path):
    import torch
    import torch.nn.functional as F
    from torch import nn

    (controller_ns, controller_ip), *worker_hosts = hosts[0]
    procs = hosts[1]
    token = tmp_path / "token"
    cli = [sys.executable, "-m", "atoll.cli"]

    def spawn(ns: str, *args: str, name: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "w")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, *cli, *args, "--ready-file", str(tmp_path / name)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        procs.append(proc)
        return proc

    wait_for_file(
        tmp_path / "c",
        spawn(controller_ns, "controller", "--host", "0.0.0.0", "--port", "0", "--token-file", str(token), name="c"),
    )
    port = (tmp_path / "c").read_text().strip().rsplit(":", 1)[1]
    address = f"{controller_ip}:{port}"  # what other hosts use; the controller bound 0.0.0.0
    for i, (ns, ip) in enumerate(worker_hosts):
        proc = spawn(
            ns,
            "worker",
            "--controller",
            address,
            "--host",
            "0.0.0.0",
            "--advertise-host",
            ip,
            "--token-file",
            str(token),
            name=f"w{i}",
        )
        assert wait_for_file(tmp_path / f"w{i}", proc).startswith(f"{ip}:")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    with atoll.connect(address, token_file=str(token)) as client:
        workers = client.status().workers
        assert sorted(w.address.split(":")[0] for w in workers) == sorted(ip for _, ip in worker_hosts)
        job = client.pipeline(
            model,
            example_input=x,
            example_target=y,
            loss_fn=F.mse_loss,
            stages=2,
            microbatches=2,
            schedule="1f1b",
            optimizer="sgd",
            optimizer_args={"lr": 0.1},
        )
        losses = [job.step(x, y) for _ in range(4)]
        assert losses[-1] < losses[0]
        job.close()
