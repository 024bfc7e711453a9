"""A worker's memory of a job's steps (atoll.worker.ledger): a step sent twice runs once."""

import threading

import pytest

from atoll._rpc import atoll_pb2 as pb
from atoll.errors import InvalidInput
from atoll.worker import ledger as ledger_module
from atoll.worker.ledger import StepLedger


def reply(loss: float) -> pb.RunStepReply:
    return pb.RunStepReply(microbatch_losses=[loss])


def test_a_step_sent_again_gets_its_first_reply_and_does_not_run():
    ledger, runs = StepLedger("job0.ab"), []
    for step in (1, 2):
        assert ledger.run(step, "train", lambda s=step: runs.append(s) or reply(s), 1.0).microbatch_losses == [step]
    assert ledger.run(1, "train", lambda: runs.append("again") or reply(9), 1.0).microbatch_losses == [1]
    assert runs == [1, 2]
    held = ledger.held("job0")
    assert (held.namespace, held.last_step, held.last_done, held.train_steps) == ("job0.ab", 2, 2, 2)


def test_a_step_sent_again_while_its_first_run_goes_on_waits_for_it():
    ledger, go = StepLedger(""), threading.Event()
    first = threading.Thread(target=lambda: ledger.run(3, "train", lambda: go.wait(10) and reply(3), 10.0))
    first.start()
    while ledger.held("j").last_step != 3:
        pass
    got = []
    second = threading.Thread(target=lambda: got.append(ledger.run(3, "train", lambda: reply(99), 10.0)))
    second.start()
    go.set()
    first.join(10)
    second.join(10)
    assert got[0].microbatch_losses == [3]
    assert ledger.held("j").train_steps == 1  # ran once


def test_errors_are_kept_too_and_a_forgotten_step_is_refused(monkeypatch):
    monkeypatch.setattr(ledger_module, "KEPT_REPLIES", 2)
    ledger = StepLedger("")
    with pytest.raises(RuntimeError, match="boom"):
        ledger.run(1, "evaluate", lambda: (_ for _ in ()).throw(RuntimeError("boom")), 1.0)
    with pytest.raises(RuntimeError, match="boom"):  # the same outcome, not a second run
        ledger.run(1, "evaluate", lambda: reply(1), 1.0)
    for step in (2, 3):
        ledger.run(step, "evaluate", lambda s=step: reply(s), 1.0)
    with pytest.raises(InvalidInput, match="step 1 already ran on this worker and its reply is no longer kept"):
        ledger.run(1, "evaluate", lambda: reply(1), 1.0)
    assert ledger.held("j").train_steps == 0
