"""Step channels (runtime/worker/channel.py, atoll.net.step_channel): the controller's steps to a
worker on one long-lived stream. Every cluster test dispatches through them (a killed or frozen
worker: tests/test_failures.py; bench/sim_workers.py's simulated ones, tests/test_benchmarks.py);
these check the worker's end on its own."""

import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from atoll._rpc import atoll_pb2 as pb
from atoll.client.local import stop_processes as stop
from atoll.errors import NotFound
from atoll.worker.channel import StepChannels
from tests import models
from tests.procs import live_workers, wait_for_file

ATOLL = [sys.executable, "-m", "atoll.cli"]


def test_each_step_is_answered_with_its_id_as_it_ends_and_failures_keep_their_code():
    """Step 1 waits until step 2 has ended, so the answers come out of order; step 3 raises an atoll
    error and step 4 a bug: each answer carries the code and words the unary RunStep would abort
    with. The stream of answers ends once the requests have, and every step has been answered."""
    second_ended = threading.Event()

    def run(request: pb.RunStepRequest) -> pb.RunStepReply:
        if request.step == 1:
            assert second_ended.wait(10)
        if request.step == 3:
            raise NotFound("job j is not loaded here")
        if request.step == 4:
            raise ValueError("a bug")
        reply = pb.RunStepReply(microbatch_losses=[request.step])
        if request.step == 2:
            threading.Timer(0.05, second_ended.set).start()  # after this answer is on its way
        return reply

    requests = [pb.ChannelStep(id=10 + i, step=pb.RunStepRequest(job_id="j", step=i)) for i in (1, 2, 3, 4)]
    answers = list(StepChannels(run, threads=4).serve(iter(requests)))
    by_id = {a.id: a.result for a in answers}
    assert sorted(by_id) == [11, 12, 13, 14] and len(answers) == 4
    assert [a.id for a in answers].index(12) < [a.id for a in answers].index(11)  # as they ended
    assert list(by_id[11].reply.microbatch_losses) == [1] and list(by_id[12].reply.microbatch_losses) == [2]
    assert by_id[11].code == 0 and by_id[12].code == 0
    assert by_id[13].code == grpc.StatusCode.NOT_FOUND.value[0] and "job j is not loaded here" in by_id[13].error
    assert by_id[14].code == grpc.StatusCode.INTERNAL.value[0] and by_id[14].error == "RunStep: ValueError: a bug"


def test_a_broken_request_stream_ends_the_answers_after_the_running_steps():
    """The controller went away mid-stream: the steps already taken still end and are answered
    (their gang turn is the worker's to finish); nothing waits for more."""
    release = threading.Event()

    def requests():
        yield pb.ChannelStep(id=1, step=pb.RunStepRequest(step=1))
        raise grpc.RpcError()  # what a cancelled stream's request iterator raises

    def run(request):
        assert release.wait(10)
        return pb.RunStepReply(microbatch_losses=[request.step])

    threading.Timer(0.05, release.set).start()
    answers = list(StepChannels(run, threads=2).serve(requests()))
    assert [(a.id, list(a.result.reply.microbatch_losses)) for a in answers] == [(1, [1])]


@pytest.mark.cluster
def test_a_step_past_its_deadline_fails_and_the_channel_serves_the_next_job(tmp_path):
    """The stream has no deadline, each step has its own (the controller's ``--step-timeout``): a
    step on a frozen worker (not yet declared dead: the heartbeat timeout is longer) fails at it,
    naming the worker's address, and once the worker wakes the same stream carries a new job's
    steps (the late answer of the old step is dropped)."""
    import atoll

    token = tmp_path / "token"
    procs: list[subprocess.Popen] = []

    def start(name: str, *args: str) -> str:
        ready = tmp_path / f"{name}.ready"
        cmd = [*ATOLL, *args, "--token-file", str(token), "--ready-file", str(ready)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        return wait_for_file(ready, procs[-1])

    try:
        address = start("controller", "controller", "--port", "0", "--step-timeout", "2", "--heartbeat-timeout", "60")
        start("worker", "worker", "--controller", address)
        worker = procs[-1]
        with atoll.connect(address, token_file=str(token)) as client:
            live_workers(client, 1)
            job, _, batches, _ = models.submit(client, stages=1, microbatches=2)
            job.step(*batches[0])
            worker.send_signal(signal.SIGSTOP)
            try:
                started = time.monotonic()
                with pytest.raises(atoll.AtollError, match="RunStep on .*: no answer before the deadline"):
                    job.step(*batches[0])
                assert time.monotonic() - started < 2 + 10  # the step's deadline, not the heartbeat's
            finally:
                worker.send_signal(signal.SIGCONT)
            job.close()
            fresh, _, fresh_batches, _ = models.submit(client, seed=2, stages=1, microbatches=2)
            losses = [fresh.step(*fresh_batches[0]) for _ in range(3)]
            assert losses[-1] < losses[0]
            fresh.close()
    finally:
        stop(procs)
