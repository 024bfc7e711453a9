"""The controller sends a job's steps in the client's numbering, and skips a number that never comes."""

import threading
import time
from dataclasses import dataclass, field

import pytest

from atoll.controller.service import ControllerService
from atoll.errors import InvalidInput


@dataclass
class _Job:
    job_id: str = "job0"
    next_seq: int = 1
    order: threading.Condition = field(default_factory=threading.Condition)


@pytest.fixture()
def service():
    svc = ControllerService(token="t")
    yield svc
    svc.stop()


def take_turns(service, job, seqs):
    """Each step number's call arrives in the listed order: it holds ``job.order`` from its arrival
    until it waits for its turn or goes, so the next starts only after that."""
    went, arrived = [], []

    def send(seq):
        with job.order:
            arrived.append(seq)
            service.stepper.await_turn(job, seq)
            went.append(seq)
            job.next_seq = seq + 1
            job.order.notify_all()

    threads = [threading.Thread(target=send, args=(s,)) for s in seqs]
    for seq, t in zip(seqs, threads):
        t.start()
        deadline = time.monotonic() + 10
        while seq not in arrived:
            assert time.monotonic() < deadline, f"step {seq} never arrived"
            time.sleep(0.001)
    for t in threads:
        t.join(10)
    return went


def test_steps_go_out_in_the_clients_order(service):
    assert take_turns(service, _Job(), [2, 3, 1]) == [1, 2, 3]


def test_a_lost_step_number_is_skipped(service):
    service.stepper.STEP_ORDER_TIMEOUT_S = 0.2
    job = _Job()
    assert take_turns(service, job, [1, 3]) == [1, 3]
    with pytest.raises(InvalidInput, match=r"step number 2 is already used \(3 steps have gone out\)"):
        with job.order:
            service.stepper.await_turn(job, 2)
