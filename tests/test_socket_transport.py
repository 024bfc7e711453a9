"""The socket transport between two ranks: real sockets (Unix-domain and TCP), each rank in a
thread of its own, meeting at an in-process rendezvous store."""

from __future__ import annotations

import json
import socket
import threading

import pytest
import torch
import torch.distributed as dist

from atoll.worker.transports import socket_setup
from atoll.worker.transports.gloo import DataPlaneError
from atoll.worker.transports.sockets import SocketTransport

TIMEOUT_S = 20.0


def pair(timeout_s: float = TIMEOUT_S, store=None, before_rank_1=None) -> list[SocketTransport]:
    """Ranks 0 and 1 connected to each other; ``before_rank_1(store)`` runs once rank 0 listens."""
    store = store or dist.HashStore()
    made: dict[int, SocketTransport | BaseException] = {}

    def make(rank: int) -> None:
        try:
            made[rank] = SocketTransport(
                store=store, rank=rank, peers=[1 - rank], host="127.0.0.1", timeout_s=timeout_s
            )
        except BaseException as e:  # noqa: BLE001 - surfaced below
            made[rank] = e

    first = threading.Thread(target=make, args=(0,))
    first.start()
    store.wait(["socket/0"])
    if before_rank_1 is not None:
        before_rank_1(store)
    make(1)
    first.join(timeout_s)
    for rank in (0, 1):
        if isinstance(made[rank], BaseException):
            raise made[rank]
    return [made[0], made[1]]


@pytest.fixture
def ranks():
    transports = pair()
    yield transports
    for t in transports:
        t.close()


def test_one_machine_uses_a_unix_socket_and_tcp_otherwise(ranks, monkeypatch):
    assert {t._peers[1 - t.rank].sock.family for t in ranks} == {socket.AF_UNIX}
    monkeypatch.setattr(socket_setup, "machine_id", lambda: "")  # as if the machine were unknown: TCP
    over_tcp = pair()
    try:
        assert {t._peers[1 - t.rank].sock.family for t in over_tcp} == {socket.AF_INET}
        got = torch.empty(3)
        wait = over_tcp[1].recv(got, 0, tag=5)
        over_tcp[0].send(torch.tensor([1.0, 2.0, 3.0]), 1, tag=5).wait(TIMEOUT_S)
        wait.wait(TIMEOUT_S)
        assert got.tolist() == [1.0, 2.0, 3.0]
    finally:
        for t in over_tcp:
            t.close()


def test_messages_match_their_tags_whatever_the_order_they_come_and_are_posted(ranks):
    sender, receiver = ranks
    a, b = torch.arange(4.0), torch.arange(6, dtype=torch.bfloat16)
    for tag, tensor in [(2, b), (1, a)]:  # sent before any receive is posted: held on arrival
        sender.send(tensor, 1, tag).wait(TIMEOUT_S)
    got_a, got_b = torch.empty(4), torch.empty(6, dtype=torch.bfloat16)
    wait_a = receiver.recv(got_a, 0, tag=1)
    wait_b = receiver.recv(got_b, 0, tag=2)
    wait_b.wait(TIMEOUT_S)
    wait_a.wait(TIMEOUT_S)
    assert torch.equal(got_a, a) and torch.equal(got_b, b)
    # two messages of one tag arrive in the order sent; empty and non-contiguous tensors travel too
    first, second = torch.empty(2, 2), torch.empty(2, 2)
    posted = [receiver.recv(first, 0, tag=7), receiver.recv(second, 0, tag=7), receiver.recv(torch.empty(0), 0, tag=8)]
    matrix = torch.arange(4.0).view(2, 2)
    for tensor, tag in [(matrix.t(), 7), (matrix, 7), (torch.empty(0), 8)]:
        sender.send(tensor, 1, tag).wait(TIMEOUT_S)
    for w in posted:
        w.wait(TIMEOUT_S)
    assert torch.equal(first, matrix.t()) and torch.equal(second, matrix)


def test_two_ranks_sending_large_tensors_to_each_other_at_once_both_finish(ranks):
    """Each send blocks until the peer reads, and reads the peer's send meanwhile: 16 MiB each
    way, far beyond the sockets' buffers, before either rank posts its receive."""
    big = [torch.full((4 << 20,), float(r + 1)) for r in (0, 1)]
    got = [torch.empty(4 << 20) for _ in (0, 1)]
    errors = []

    def run(rank: int) -> None:
        try:
            ranks[rank].send(big[rank], 1 - rank, tag=rank).wait(TIMEOUT_S)
            ranks[rank].recv(got[rank], 1 - rank, tag=1 - rank).wait(TIMEOUT_S)
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT_S)
    assert not errors and not any(t.is_alive() for t in threads)
    assert torch.equal(got[0], big[1]) and torch.equal(got[1], big[0])


def test_a_large_send_goes_on_in_the_background_and_later_sends_keep_their_order(ranks):
    """The sending thread is free at once (as gloo's): the receiver may be busy elsewhere, e.g. in
    a collective, and read the tensor only when it waits for it."""
    sender, receiver = ranks
    big, small = torch.full((4 << 20,), 7.0), torch.tensor([1.0, 2.0])
    first = sender.send(big, 1, tag=1)
    second = sender.send(small, 1, tag=2)  # queued behind the first: the stream keeps send order
    assert not first.done()
    got_small, got_big = torch.empty(2), torch.empty(4 << 20)
    receiver.recv(got_small, 0, tag=2).wait(TIMEOUT_S)  # reads past the big one, held for its receive
    receiver.recv(got_big, 0, tag=1).wait(TIMEOUT_S)
    first.wait(TIMEOUT_S)
    second.wait(TIMEOUT_S)
    assert first.done() and second.done()  # what an interleaver asks before waiting in a thread
    assert torch.equal(got_small, small) and torch.equal(got_big, big)


def test_a_second_waiting_thread_gets_its_message_from_the_thread_reading(ranks):
    sender, receiver = ranks
    got = [torch.empty(2), torch.empty(2)]
    waits = [receiver.recv(got[i], 0, tag=i) for i in (0, 1)]
    errors = []

    def wait(i: int) -> None:
        try:
            waits[i].wait(TIMEOUT_S)
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=wait, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    sender.send(torch.tensor([3.0, 4.0]), 1, tag=1).wait(TIMEOUT_S)
    sender.send(torch.tensor([1.0, 2.0]), 1, tag=0).wait(TIMEOUT_S)
    for t in threads:
        t.join(TIMEOUT_S)
    assert not errors and [g.tolist() for g in got] == [[1.0, 2.0], [3.0, 4.0]]


def test_a_message_of_the_wrong_size_fails_its_receive_and_the_next_one_lines_up(ranks):
    sender, receiver = ranks
    small, right = torch.empty(2), torch.empty(3)
    wrong = receiver.recv(small, 0, tag=1)
    after = receiver.recv(right, 0, tag=2)
    sender.send(torch.arange(5.0), 1, tag=1).wait(TIMEOUT_S)
    sender.send(torch.arange(3.0), 1, tag=2).wait(TIMEOUT_S)
    with pytest.raises(DataPlaneError, match="the message has 20 bytes, the buffer 8"):
        wrong.wait(TIMEOUT_S)
    after.wait(TIMEOUT_S)
    assert right.tolist() == [0.0, 1.0, 2.0]


def test_a_receive_times_out_and_a_lost_peer_fails_waits_at_once(ranks):
    sender, receiver = ranks
    with pytest.raises(DataPlaneError, match=r"receive from rank 0 \(tag 9\) timed out after 0.2s"):
        receiver.recv(torch.empty(1), 0, tag=9).wait(0.2)
    pending = receiver.recv(torch.empty(1), 0, tag=10)
    sender.close()  # the peer goes away: the wait ends now, not at its deadline
    with pytest.raises(DataPlaneError, match="connection to rank 0 lost"):
        pending.wait(TIMEOUT_S)
    with pytest.raises(DataPlaneError, match="connection to rank 0 lost"):
        receiver.recv(torch.empty(1), 0, tag=11)
    assert "failed" in str(pytest.raises(DataPlaneError, sender.send(torch.ones(1), 1, tag=3).wait, 1).value)


def test_a_connection_without_the_nonce_is_dropped_and_the_ranks_still_meet():
    strangers = []

    def knock(store) -> None:  # someone who can reach the port but cannot read the job's store
        host, port = json.loads(store.get("socket/0"))["tcp"]
        s = socket.create_connection((host, port))
        s.sendall(socket_setup.HELLO.pack(1, b"\0" * 16))
        strangers.append(s)

    transports = pair(before_rank_1=knock)
    try:
        assert strangers[0].recv(1) == b""  # closed by rank 0
        got = torch.empty(1)
        wait = transports[0].recv(got, 1, tag=0)
        transports[1].send(torch.ones(1), 0, tag=0).wait(TIMEOUT_S)
        wait.wait(TIMEOUT_S)
        assert got.item() == 1.0
    finally:
        strangers[0].close()
        for t in transports:
            t.close()


def test_a_peer_that_never_connects_fails_the_setup_with_its_rank():
    store = dist.HashStore()
    with pytest.raises(DataPlaneError, match=r"rank 0 could not connect to ranks \[1\]: ranks \[1\] did not connect"):
        SocketTransport(store=store, rank=0, peers=[1], host="127.0.0.1", timeout_s=0.5)
