"""Issue 25: jobs survive a controller restart. Daemons as an operator runs them (`atoll controller
--state-dir`, `atoll worker`; forked from the zygote LocalClusters use, which runs the same
commands without a fresh interpreter's imports: tests/test_by_hand.py starts them from fresh
interpreters), a 4-stage job trains in float64 under AdamW; the controller is SIGKILLed with
steps in flight and started again on the same port and state directory. The client's unanswered
steps go out again and succeed; losses and weights equal a single-process run's (so no step ran
twice, none was lost), and status lists every worker once, with its id."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import atoll
from atoll._rpc import atoll_pb2 as pb
from atoll._rpc import atoll_pb2_grpc as pb_grpc
from atoll.client.local import daemon_env, stop_processes
from atoll.client.zygote import ForkedProcess, zygote_for
from atoll.errors import NotFound
from atoll.net.rpc import Endpoint
from tests import models, ps_cases
from tests.procs import live_workers, wait_for_file
from tests.reference import RTOL, assert_matches_reference, train_reference

pytestmark = pytest.mark.cluster  # every test here starts processes

ADAMW = {"lr": 1e-3, "weight_decay": 0.01}
HEARTBEAT_TIMEOUT_S = 3.0
# From the restarted controller's readiness to every unanswered step answered: the workers
# registering again (a heartbeat interval) and the job compiled again (about 3 s here). The issue
# asks for under 10 s after the restart; the time from the kill (the new process's start, which a
# loaded machine can stretch past that alone) is recorded beside it.
BACK_WITHIN_S = 10.0


class Daemons:
    """`atoll controller` and `atoll worker` processes of one test, all stopped at its end."""

    def __init__(self, tmp_path: Path):
        self.tmp, self.token = tmp_path, tmp_path / "token"
        self.procs: list[ForkedProcess] = []
        self.port = 0
        self._count = 0
        self._zygote, self._owns_zygote = zygote_for(daemon_env(), tmp_path, 120.0)

    def _start(self, *args: str) -> tuple[ForkedProcess, str]:
        self._count += 1
        ready = self.tmp / f"{self._count}.ready"
        log = self.tmp / f"{self._count}-{args[0]}.log"
        argv = [
            *args,
            "--token-file",
            str(self.token),
            "--ready-file",
            str(ready),
            "--exit-with-parent",
            str(os.getpid()),
        ]
        self.procs.append(self._zygote.spawn(argv, str(log), daemon_env()))
        return self.procs[-1], wait_for_file(ready, self.procs[-1])

    def stop(self) -> None:
        stop_processes(self.procs)
        if self._owns_zygote:
            self._zygote.close()

    def controller(self, state: str = "state") -> ForkedProcess:
        proc, address = self._start(
            "controller",
            *("--port", str(self.port), "--state-dir", str(self.tmp / state)),
            *("--heartbeat-interval", "0.5", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)),
        )
        self.port = int(address.rsplit(":", 1)[1])
        return proc

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def worker(self) -> ForkedProcess:
        return self._start("worker", "--controller", self.address)[0]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.tmp.glob("*.log")))


@pytest.fixture()
def daemons(tmp_path):
    d = Daemons(tmp_path)
    yield d
    d.stop()


def _float64_mlp():
    model, batches, loss_fn = models.in_float64(models.mlp)
    return model, batches * 2, loss_fn  # 10 steps


def _kill_mid_step(daemons, job, batches, controller) -> tuple[list, float, float]:
    """Send four steps, SIGKILL the controller while they are in flight, start it again; returns
    the futures, when the kill happened and when the new controller was ready."""
    futures = [job.step_async(*b) for b in batches]
    controller.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    controller.wait(10)
    daemons.controller()
    return futures, killed, time.monotonic()


def test_a_killed_controller_takes_its_job_back_and_no_step_runs_twice(daemons, record_property):
    model, batches, loss_fn = _float64_mlp()
    expected_losses, expected_state = train_reference(model, batches, loss_fn, 2, "adamw", ADAMW)
    controller = daemons.controller()
    for _ in range(4):
        daemons.worker()
    with atoll.connect(daemons.address, token_file=str(daemons.token)) as client:
        workers = live_workers(client, 4)
        x, y = batches[0]
        job = client.pipeline(
            model, example_input=x, example_target=y, loss_fn=loss_fn, stages=4, microbatches=2,
            optimizer="adamw", optimizer_args=ADAMW, name="survivor",
        )  # fmt: skip
        losses = [job.step(*b) for b in batches[:3]]

        futures, killed, restarted = _kill_mid_step(daemons, job, batches[3:7], controller)
        record_property("answered_before_the_kill", sum(f.done() for f in futures))
        losses += [f.result() for f in futures]
        answered = time.monotonic()
        record_property("kill_to_every_step_answered_s", round(answered - killed, 2))
        record_property("restart_to_every_step_answered_s", round(answered - restarted, 2))
        assert answered - restarted < BACK_WITHIN_S, f"{answered - restarted:.1f} s\n{daemons.logs()}"

        losses += [job.step(*b) for b in batches[7:]]
        assert_matches_reference(losses, job.state_dict(), expected_losses, expected_state, RTOL)

        assert live_workers(client, 4) == workers  # each worker once, with its old id and process
        (status,) = [j for j in client.status().jobs if j.job_id == job.id]
        assert status.state == "ready" and status.steps == len(batches)
        job.close()


def test_a_job_that_lost_a_worker_while_the_controller_was_down_resumes_on_a_spare(daemons, tmp_path):
    model, batches, loss_fn = _float64_mlp()
    expected_losses, expected_state = train_reference(model, batches, loss_fn, 2, "adamw", ADAMW)
    controller = daemons.controller()
    workers = [daemons.worker() for _ in range(5)]
    with atoll.connect(daemons.address, token_file=str(daemons.token)) as client:
        live_workers(client, 5)
        x, y = batches[0]
        job = client.pipeline(
            model, example_input=x, example_target=y, loss_fn=loss_fn, stages=4, microbatches=2,
            optimizer="adamw", optimizer_args=ADAMW, auto_resume=True, checkpoint_every=3,
            checkpoint_path=tmp_path / "ckpt",
        )  # fmt: skip
        losses = [job.step(*b) for b in batches[:5]]  # a checkpoint after step 3, steps 4 and 5 journaled
        by_pid = {w.pid: w for w in workers}
        placed = {w.worker_id: w.pid for w in client.status().workers if job.id in w.jobs}
        victim_id = job.plan.report["placement"]["2"].split()[0]

        controller.send_signal(signal.SIGKILL)
        controller.wait(10)
        victim = by_pid[placed[victim_id]]
        victim.kill()  # while the controller is down
        victim.wait(10)
        daemons.controller()
        losses += [job.step(*b) for b in batches[5:]]
        assert_matches_reference(losses, job.state_dict(), expected_losses, expected_state, RTOL)

        report = client.job(job.id).plan.report
        (restore,) = report["restores"]
        assert restore["lost"] == [victim_id] and victim_id not in restore["workers"]
        assert restore["from_step"] == 3 and restore["replayed_steps"] == 2
        listed = {w.worker_id: w for w in client.status(all=True).workers}
        assert not listed[victim_id].alive
        job.close()


def test_a_controller_restarted_on_an_empty_state_directory_knows_each_worker_once(daemons):
    """No records: the workers register again, asking for their ids (no collision, as there is no
    other holder); one killed afterwards is reported dead within the heartbeat timeout."""
    controller = daemons.controller("first")
    workers = [daemons.worker() for _ in range(2)]
    with atoll.connect(daemons.address, token_file=str(daemons.token)) as client:
        before = live_workers(client, 2)
        controller.kill()
        controller.wait(10)
        daemons.controller("empty")
        assert live_workers(client, 2) == before
        workers[0].kill()
        workers[0].wait(10)
        killed = time.monotonic()
        (left,) = live_workers(client, 1).values()
        assert left == workers[1].pid
        assert time.monotonic() - killed < HEARTBEAT_TIMEOUT_S + 5  # room for a loaded machine


def test_a_controller_that_does_not_come_back_fails_the_step_naming_it(daemons):
    """The client sends its unanswered step again for ``reconnect_timeout_s``, then raises
    ControllerUnavailable naming the controller's address (not a worker's)."""
    model, batches, loss_fn = _float64_mlp()
    controller = daemons.controller()
    daemons.worker()
    with atoll.connect(daemons.address, token_file=str(daemons.token), reconnect_timeout_s=2.0) as client:
        live_workers(client, 1)
        x, y = batches[0]
        job = client.pipeline(model, example_input=x, example_target=y, loss_fn=loss_fn, stages=1, microbatches=2)
        job.step(x, y)
        controller.kill()
        controller.wait(10)
        started = time.monotonic()
        with pytest.raises(atoll.ControllerUnavailable, match=f"{daemons.address}: controller unreachable") as err:
            job.step(x, y)
        assert "may or may not have run" in str(err.value) and time.monotonic() - started < 2.0 + 10
        with pytest.raises(atoll.ControllerUnavailable, match=daemons.address):
            client.status()


def test_the_state_directory_keeps_its_records_across_opening(tmp_path):
    """The store by itself: what one controller records, the next reads back."""
    from atoll._rpc import atoll_pb2 as pb
    from atoll.controller.statedir import JobRow, StateDir, WorkerRow

    store = StateDir(tmp_path / "state")
    store.worker(WorkerRow("w0", "127.0.0.1:1", "cpu", "a", "host"))
    store.worker(WorkerRow("w1", "127.0.0.1:2", "cpu", "a", "host"))
    store.worker_died("w1")
    store.next_job(3)
    row = JobRow("job2", "n", "s", ("",), ("w0",), "", "", "loading", "", 0, {})
    store.job_admitted(row, pb.PipelineProgram(session="s"))
    store.job_loaded("job2", ["w0"], "job2.ab", "secret", 5, {"name": "n"})
    store.job_state("job2", "ready")
    step = pb.StepRequest(job_id="job2", seq=6)
    store.journal_append("job2", 6, step, 0.5)
    store.journal_append("job2", 7, step, 0.25)
    store.job_admitted(JobRow("job1", "m", "", (), ("w0",), "", "", "loading", "", 0, {}), pb.PipelineProgram())
    store.job_closed("job1")
    store.close()

    read = StateDir(tmp_path / "state").read()
    assert [(w.worker_id, w.alive) for w in read.workers] == [("w0", True), ("w1", False)]
    assert read.next_job == 3 and read.closed == {"job1"}
    (job,) = read.jobs
    assert (job.job_id, job.placement, job.namespace, job.secret, job.state) == (
        "job2",
        ("w0",),
        "job2.ab",
        "secret",
        "ready",
    )
    assert job.steps_at_load == 5 and job.report == {"name": "n"}
    assert pb.PipelineProgram.FromString(job.program).session == "s"
    assert [(seq, loss) for seq, _, loss in job.journal] == [(6, 0.5), (7, 0.25)]
    assert not (tmp_path / "state" / "programs" / "job1.pb").exists()
    assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700


def test_a_parameter_server_job_is_taken_back_after_a_restart_and_dropped_without_its_record(daemons):
    """Its server and tasks serve the client while the controller is down (the data path never
    passes through it); the controller restarted on its state directory lists the job again,
    trains on, and closing it unloads it from its workers. Then a second job, and a restart on an
    empty state directory: that controller knows no such job, and its workers, registering again,
    drop their roles (as they drop pipeline jobs), so nothing is left serving that no one could close."""
    model = ps_cases.mlp()
    rounds = ps_cases.dense_batches(6, 2, dtype=torch.float32)
    controller = daemons.controller()
    for _ in range(3):
        daemons.worker()
    token = daemons.token.read_text().strip()
    with atoll.connect(daemons.address, token_file=str(daemons.token)) as client:
        workers = live_workers(client, 3)
        x, y = rounds[0][0]
        job = client.parameter_server(
            model, example_input=x, example_target=y, loss_fn=F.cross_entropy, servers=1, workers=2, lr=0.05
        )
        feed = [[r[t] for r in rounds] for t in range(2)]
        job.run([f[:2] for f in feed])
        controller.send_signal(signal.SIGKILL)
        controller.wait(10)
        job.run([f[2:4] for f in feed])  # no controller: the tasks and the server go on
        controller = daemons.controller()
        assert live_workers(client, 3) == workers
        (listed,) = [j for j in client.status().jobs if j.job_id == job.job_id]
        assert listed.schedule == "parameter-server sequential" and sorted(listed.workers) == sorted(workers)
        job.run([f[4:] for f in feed])
        assert not job.errors and [r.iteration for r in job.records if r.task == 0] == list(range(6))
        job.close()
        assert job.job_id not in {j.job_id for j in client.status().jobs}
        server = Endpoint(job.layout.servers[0], token, pb_grpc.ParameterServerStub, 10.0)
        with pytest.raises(NotFound, match=job.job_id):
            server.call("Pull", pb.PsPullRequest(job_id=job.job_id, shard=0, keys=[job.keys[0].key]))

        second = client.parameter_server(
            model, example_input=x, example_target=y, loss_fn=F.cross_entropy, servers=1, workers=1
        )
        assert second.step_task(0, x, y).iteration == 0
        controller.kill()
        controller.wait(10)
        daemons.controller("empty")
        live_workers(client, 3)
        assert second.job_id not in {j.job_id for j in client.status().jobs}
        server = Endpoint(second.layout.servers[0], token, pb_grpc.ParameterServerStub, 10.0)
        pull = pb.PsPullRequest(job_id=second.job_id, shard=0, keys=[second.keys[0].key], no_wait=True)
        deadline = time.monotonic() + 10.0
        while True:  # the worker drops its roles right after the controller answered its registration
            try:
                server.call("Pull", pull)
            except NotFound:
                break
            assert time.monotonic() < deadline, "the server still serves a job its controller does not know"
            time.sleep(0.1)
        with pytest.raises(NotFound, match="has no task on this worker"):
            second.step_task(0, x, y)
