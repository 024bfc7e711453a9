"""Checkpoints written by the workers (safetensors + a JSON manifest): a restored job continues
with the losses of an uninterrupted run (1e-5), whatever layout it is restored into; a save that
fails part-way leaves the previous checkpoint current and loadable."""

import json
import time

import pytest
import safetensors

import atoll
from atoll.core import checkpoint
from tests import models
from tests.reference import RTOL, train_reference

pytestmark = pytest.mark.cluster  # every test here starts processes

ADAMW = {"lr": 1e-3, "weight_decay": 0.01}


def _job(client, model, batches, loss_fn, **layout):
    x, y = batches[0]
    return client.pipeline(
        model, example_input=x, example_target=y, loss_fn=loss_fn, microbatches=2, schedule="1f1b",
        optimizer="adamw", optimizer_args=ADAMW, **layout,
    )  # fmt: skip


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= RTOL * abs(y) for x, y in zip(a, b))


def test_a_checkpoint_resumes_in_other_layouts_with_the_losses_of_an_uninterrupted_run(client4, tmp_path):
    model, batches, loss_fn = models.transformer()
    batches = batches * 2  # 10 steps: 2 before the save, 8 after
    expected, _ = train_reference(model, batches, loss_fn, 2, "adamw", ADAMW)
    path = tmp_path / "ckpt"
    with _job(client4, model, batches, loss_fn, stages=4) as job:
        before = [job.step(x, y) for x, y in batches[:2]]
        saved = job.save(path)
        after = [job.step(x, y) for x, y in batches[2:4]]
    assert _close(before + after, expected[:4])
    assert saved["step"] == 2 and (path / "current").read_text().strip() == saved["version"]
    version = path / saved["version"]
    manifest = json.loads((version / "manifest.json").read_text())
    assert manifest["layout"]["pipeline"] == 4 and len(manifest["files"]) == 4
    with safetensors.safe_open(str(version / manifest["files"][0]["file"]), framework="pt") as f:
        keys = set(f.keys())  # plain safetensors: weights and Adam's moments under the model's names
    assert {"param/0.tokens.weight", "optim/0.tokens.weight/exp_avg", "optim/0.tokens.weight/step"} <= keys

    # 4 stages -> 2 stages, then -> 2 stages sharded over 2-worker islands, then back to 1 stage
    for layout, steps in (({"stages": 2}, slice(2, 4)), ({"stages": 1, "tensor_parallel": 2}, slice(2, 6))):
        with _job(client4, model, batches, loss_fn, resume_from=path, **layout) as resumed:
            assert resumed.plan.report["resumed_from"]["step"] == 2
            losses = [resumed.step(x, y) for x, y in batches[steps]]
            if "tensor_parallel" in layout:
                tp_save = resumed.save(tmp_path / "from-tp")  # cut by vocabulary and heads on disk
        assert _close(losses, expected[steps]), (layout, losses, expected[steps])
    with _job(client4, model, batches, loss_fn, stages=1, resume_from=tmp_path / "from-tp") as back:
        assert _close([back.step(x, y) for x, y in batches[6:]], expected[6:])
    assert tp_save["step"] == 6


def test_a_crash_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """The worker of rank 1 dies (SIGKILL) half-way through writing its file of the second save
    (a failpoint, atoll.core.checkpoint.FAILPOINT): the save fails with the worker named, the
    partial version is removed, and ``current`` still names the last complete checkpoint, from
    which a new job continues exactly."""
    model, batches, loss_fn = models.transformer()
    expected, _ = train_reference(model, batches, loss_fn, 2, "adamw", ADAMW)
    path = tmp_path / "ckpt"
    monkeypatch.setenv(checkpoint.FAILPOINT, f"checkpoint-write:{path}/v000002-*/rank1-tp0.safetensors")
    with atoll.LocalCluster(workers=3) as cluster, cluster.client() as client:
        job = _job(client, model, batches, loss_fn, stages=2)
        job.step(*batches[0])
        first = job.save(path)
        job.step(*batches[1])
        with pytest.raises(atoll.AtollError, match="previous checkpoint is kept"):
            job.save(path)
        # the writer of rank 1 was killed; its exit code comes once its parent (the zygote of a
        # CPU cluster) has reaped it, which may be after the save has failed
        deadline = time.monotonic() + 10
        while [p.poll() for p in cluster.workers].count(-9) != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p.poll() for p in cluster.workers].count(-9) == 1
        assert (path / "current").read_text().strip() == first["version"]
        assert sorted(p.name for p in path.iterdir()) == sorted(["current", first["version"]])
        job.close()
        with _job(client, model, batches, loss_fn, stages=2, resume_from=path) as resumed:
            assert _close([resumed.step(x, y) for x, y in batches[1:]], expected[1:])


def test_bad_checkpoints_are_refused_with_the_reason(client4, tmp_path):
    model, batches, loss_fn = models.transformer()
    with pytest.raises(atoll.InvalidInput, match="holds no complete atoll checkpoint"):
        _job(client4, model, batches, loss_fn, stages=2, resume_from=tmp_path / "nothing")
    with _job(client4, model, batches, loss_fn, stages=2) as job:
        job.step(*batches[0])
        job.save(tmp_path / "ckpt")
    x, y = batches[0]
    with pytest.raises(atoll.InvalidInput, match="holds adamw state; this job uses sgd"):
        client4.pipeline(
            model, example_input=x, example_target=y, loss_fn=loss_fn, microbatches=2, stages=2,
            resume_from=tmp_path / "ckpt",
        )  # fmt: skip
    other, other_batches, mse = models.mlp()
    with pytest.raises(atoll.InvalidInput, match="has no param/0.weight"):
        client4.pipeline(
            other, example_input=other_batches[0][0], example_target=other_batches[0][1], loss_fn=mse,
            microbatches=2, stages=1, optimizer="adamw", resume_from=tmp_path / "ckpt",
        )  # fmt: skip
    assert all(not w.jobs for w in client4.status().workers)
