"""auto_resume (controller/resume.py): a worker SIGKILLed in the middle of a 4-stage training run;
within 10 s the job is running again on a spare worker, its losses equal to an uninterrupted run's
(1e-5), while a second job on other workers keeps training throughout."""

import threading
import time

import pytest

import atoll
from tests import models
from tests.reference import RTOL, train_reference

pytestmark = pytest.mark.cluster  # every test here starts processes

ADAMW = {"lr": 1e-3, "weight_decay": 0.01}
# A kill, then the job running again: 2.2..9.4 s in 20 audit rounds (.ci/timing-audit, half of them
# beside a second suite). 30 s keeps a margin of 3x over the worst seen and still catches a resume
# that waits out the turnstile's or the data plane's deadlines instead of acting at once.
RESTORE_DEADLINE_S = 30.0


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= RTOL * abs(y) for x, y in zip(a, b))


class _Trainer(threading.Thread):
    """Steps a job over and over until told to stop, timing every step."""

    def __init__(self, job, batches):
        super().__init__(daemon=True)
        self.job, self.batches = job, batches
        self.done: list[tuple[float, float]] = []  # (finished at, loss)
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self):
        try:
            while not self.stop.is_set():
                x, y = self.batches[len(self.done) % len(self.batches)]
                self.done.append((time.monotonic(), self.job.step(x, y)))
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            self.error = e


def test_a_killed_worker_is_replaced_from_the_last_checkpoint_while_another_job_trains(tmp_path, record_property):
    model, batches, loss_fn = models.transformer()
    batches = batches * 2  # 10 steps: checkpoints after steps 3 and 6, the kill during step 6
    expected, _ = train_reference(model, batches, loss_fn, 2, "adamw", ADAMW)
    other, other_batches, mse = models.mlp()
    x, y = batches[0]
    with atoll.LocalCluster(workers=7) as cluster, cluster.client() as client:
        job = client.pipeline(
            model, example_input=x, example_target=y, loss_fn=loss_fn, stages=4, microbatches=2,
            schedule="1f1b", optimizer="adamw", optimizer_args=ADAMW,
            auto_resume=True, checkpoint_every=3, checkpoint_path=tmp_path / "ckpt",
        )  # fmt: skip
        second = client.pipeline(
            other, example_input=other_batches[0][0], example_target=other_batches[0][1], loss_fn=mse,
            stages=2, microbatches=2,
        )  # fmt: skip
        workers = {w.worker_id: w for w in client.status().workers}
        used = {w for w, s in workers.items() if job.id in s.jobs}
        spare = set(workers) - used - {w for w, s in workers.items() if second.id in s.jobs}
        assert len(used) == 4 and len(spare) == 1
        trainer = _Trainer(second, other_batches)
        trainer.start()
        try:
            losses = [job.step(*b) for b in batches[:5]]
            victim = job.plan.report["placement"]["2"].split()[0]  # the worker of rank 2
            in_flight = job.step_async(*batches[5])
            killed_at = time.monotonic()
            cluster.kill_worker(next(i for i, p in enumerate(cluster.workers) if p.pid == workers[victim].pid))
            losses.append(in_flight.result())
            back_at = time.monotonic()
            losses += [job.step(*b) for b in batches[6:]]
        finally:
            trainer.stop.set()
            trainer.join(60)
        assert trainer.error is None, trainer.error
        assert _close(losses, expected), (losses, expected)
        record_property("restore_s", back_at - killed_at)
        assert back_at - killed_at < RESTORE_DEADLINE_S, f"the job took {back_at - killed_at:.1f} s to run again"

        (restore,) = client.job(job.id).plan.report["restores"]
        assert restore["lost"] == [victim] and victim not in restore["workers"]
        assert spare <= set(restore["workers"])  # the spare worker took the dead one's place
        assert restore["from_step"] == 3 and restore["replayed_steps"] == 2
        assert restore["replay_loss_drift"] <= RTOL
        assert next(j for j in client.status().jobs if j.job_id == job.id).state == "ready"

        # the second job trained throughout, also while the first was being restored, and exactly
        during = [t for t, _ in trainer.done if killed_at <= t <= back_at]
        record_property("other_job_steps_during_restore", len(during))
        assert during, "the second job made no step while the first was restored"
        other_expected, _ = train_reference(
            other, [other_batches[i % len(other_batches)] for i in range(len(trainer.done))], mse, 2, "sgd", {}
        )
        assert _close([loss for _, loss in trainer.done], other_expected)
        job.close()
        second.close()


def test_auto_resume_needs_a_checkpoint_path(client4):
    model, batches, loss_fn = models.mlp()
    with pytest.raises(atoll.InvalidInput, match="auto_resume restores from a checkpoint: it needs checkpoint_path"):
        client4.pipeline(
            model, example_input=batches[0][0], example_target=batches[0][1], loss_fn=loss_fn, stages=2,
            microbatches=2, auto_resume=True,
        )  # fmt: skip
