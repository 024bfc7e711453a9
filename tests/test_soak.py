"""Soak: 8 client processes share 4 workers, 100 training steps each. Every one finishes with
the losses of its own single-process run (1e-5), and the daemons' memory after the run is within
10% of what it was once every client had taken its first 10 steps."""

import json
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
CLIENT = """
import json, sys
import atoll
from tests import models
seed, steps, warm = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
model, batches, loss_fn = models.mlp(seed)
x, y = batches[0]
with atoll.connect(sys.argv[1], sys.argv[2]) as client:
    job = client.pipeline(model, example_input=x, example_target=y, loss_fn=loss_fn, stages=2, microbatches=2)
    losses = []
    for i in range(steps):
        if i == warm:
            print("warm", flush=True)
            sys.stdin.readline()  # the parent measures memory, then lets every client go on
        losses.append(job.step(*batches[i % len(batches)]))
    job.close()
print(json.dumps(losses), flush=True)
"""


def test_eight_clients_share_four_workers_for_a_hundred_steps_each(tmp_path):
    with atoll.LocalCluster(workers=4, state_dir=tmp_path / "state") as cluster:
        children = [
            subprocess.Popen(
                [sys.executable, "-c", CLIENT, cluster.address, cluster.token, str(seed), str(STEPS), str(WARM)],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for seed in range(CLIENTS)
        ]
        try:
            for child in children:
                assert child.stdout.readline().strip() == "warm", "a client failed before its first steps"
            daemons = [cluster.controller, *cluster.workers]
            warm = [rss(p.pid) for p in daemons]
            for child in children:
                child.stdin.write("go\n")
                child.stdin.flush()
            results = [json.loads(child.stdout.readline()) for child in children]
            for child in children:
                assert child.wait(60) == 0
            after = [rss(p.pid) for p in daemons]
        finally:
            for child in children:
                child.kill()
    for seed, losses in enumerate(results):
        model, batches, loss_fn = models.mlp(seed)
        expected, _ = train_reference(model, [batches[i % len(batches)] for i in range(STEPS)], loss_fn, 2, "sgd", {})
        assert all(abs(a - b) <= RTOL * abs(b) for a, b in zip(losses, expected)), seed
    for before, now in zip(warm, after):
        assert now <= 1.1 * before, (warm, after)
