"""Step channels (runtime/worker/channel.py, atoll.net.step_channel): the controller's steps to a
worker on one long-lived stream. Every cluster test dispatches through them (a killed or frozen
worker: tests/test_failures.py; bench/sim_workers.py's simulated ones, tests/test_benchmarks.py);
these check the worker's end on its own."""

import threading

import grpc

from atoll._rpc import atoll_pb2 as pb
from atoll.errors import NotFound
from atoll.worker.channel import StepChannels


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
