"""Steps whose caller waits at once (``job.step``, ``evaluate``, ``forward``) go out as blocking
calls in the caller's thread (atoll.client.calls.StepCall, ``Endpoint.settled``); steps sent
ahead (``step_async``) as gRPC futures. Both kinds mixed, from two threads, train as one process."""

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.reference import assert_matches_reference, train_reference

pytestmark = pytest.mark.cluster

ADAMW = {"lr": 1e-2}


def _model_and_batches(steps: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    batches = [(torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)) for _ in range(steps)]
    return model, batches


def _submit(client, model, x, y):
    return client.pipeline(
        copy.deepcopy(model), example_input=x, example_target=y, loss_fn=F.mse_loss, stages=2, microbatches=2,
        optimizer="adamw", optimizer_args=ADAMW,
    )  # fmt: skip


def test_an_awaited_step_starts_no_thread_for_its_call(client4, monkeypatch):
    """A future's reply reaches its caller through a thread of gRPC's (started when a channel with
    no call in flight gets one); a blocking call's does not, which is what makes it cheaper."""
    model, batches = _model_and_batches(2)
    job = _submit(client4, model, *batches[0])
    job.step(*batches[0])
    started = []
    real_start = threading.Thread.start

    def counting_start(thread):
        started.append(thread.name)
        return real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", counting_start)
    for _ in range(5):
        job.step(*batches[1])
        job.evaluate(*batches[1])
        job.forward(batches[1][0])
    assert started == []
    job.step_async(*batches[1]).result()  # the other way, for contrast: its reply comes in gRPC's thread
    monkeypatch.setattr(threading.Thread, "start", real_start)
    assert started, "a step sent ahead started no thread: the contrast above no longer shows anything"
    job.close()


def test_awaited_and_sent_ahead_steps_from_two_threads_train_as_one_process(client4):
    """Thread A waits for each of its steps, thread B sends its own ahead; the job's lock orders
    their sending, and each step runs in the order it was numbered, whichever thread sent it: the
    workers' float64 AdamW weights and every loss match one process training on the batches in
    step order."""
    model, batches = _model_and_batches(12)
    job = _submit(client4, model, *batches[0])
    by_step: dict[int, tuple] = {}
    losses: dict[int, float] = {}

    def awaiting():  # as job.step, keeping the future to read the step's number
        for x, y in batches[:6]:
            future = job._send("train", x, y, wait=True)
            assert future.done()  # answered before _send returned
            by_step[future.details().step] = (x, y)
            losses[future.details().step] = future.result()

    def sending_ahead():
        futures = [(job.step_async(x, y), (x, y)) for x, y in batches[6:]]
        for future, batch in futures:
            by_step[future.details().step] = batch
            losses[future.details().step] = future.result()

    threads = [threading.Thread(target=awaiting), threading.Thread(target=sending_ahead)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    order = sorted(by_step)
    assert order == list(range(order[0], order[0] + 12))
    expected_losses, expected_state = train_reference(model, [by_step[s] for s in order], F.mse_loss, 2, "adamw", ADAMW)
    assert_matches_reference([losses[s] for s in order], job.state_dict(), expected_losses, expected_state, 1e-10)
    job.close()
