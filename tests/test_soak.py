"""Soak: 8 client processes share 4 workers, 100 training steps each. Every one finishes with
the losses of its own single-process run (1e-5), and the daemons' memory after the run is within
10% of what it was once every client had taken its first 10 steps."""

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import atoll
from tests import models
from tests.procs import rss
from tests.reference import RTOL, train_reference

pytestmark = pytest.mark.cluster  # every test here starts processes

ROOT = Path(__file__).resolve().parent.parent
CLIENTS, STEPS, WARM = 8, 100, 10


def test_eight_clients_share_four_workers_for_a_hundred_steps_each(tmp_path):
    with atoll.LocalCluster(workers=4, state_dir=tmp_path / "state") as cluster:
        # the clients: processes of their own, forked by one that imported torch and atoll once
        launcher = subprocess.Popen(
            [sys.executable, "-m", "tests.soak_clients", cluster.address, cluster.token, str(CLIENTS), str(STEPS),
             str(WARM), str(tmp_path)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        clients: list[int] = []
        try:
            lines = [launcher.stdout.readline().split() for _ in range(2 * CLIENTS)]
            clients = [int(line[2]) for line in lines if line[:1] == ["pid"]]
            warmed = sorted(int(line[1]) for line in lines if line[:1] == ["warm"])
            assert len(clients) == CLIENTS and warmed == list(range(CLIENTS)), "a client failed before its first steps"
            daemons = [cluster.controller, *cluster.workers]
            warm = [rss(p.pid) for p in daemons]
            launcher.stdin.write("go\n")
            launcher.stdin.flush()
            ended = [launcher.stdout.readline().split() for _ in range(CLIENTS)]
            done = sorted(int(line[1]) for line in ended if line[:1] == ["done"])
            assert launcher.wait(60) == 0 and done == list(range(CLIENTS)), ended
            results = {seed: json.loads((tmp_path / f"{seed}.json").read_text()) for seed in done}
            after = [rss(p.pid) for p in daemons]
        finally:
            launcher.kill()
            for pid in clients:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    for seed, losses in results.items():
        model, batches, loss_fn = models.mlp(seed)
        expected, _ = train_reference(model, [batches[i % len(batches)] for i in range(STEPS)], loss_fn, 2, "sgd", {})
        assert all(abs(a - b) <= RTOL * abs(b) for a, b in zip(losses, expected)), seed
    for before, now in zip(warm, after):
        assert now <= 1.1 * before, (warm, after)
