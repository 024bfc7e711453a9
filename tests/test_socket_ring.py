"""The replicas' gradient all-reduce as a ring over sockets (runtime/worker/transports/socket_ring.py):
real sockets, each replica in a thread of its own, meeting at an in-process rendezvous store."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from atoll.worker.transports.gloo import DataPlaneError
from atoll.worker.transports.socket_ring import SocketRing

TIMEOUT_S = 20.0


def ring(n: int, timeout_s: float = TIMEOUT_S) -> list[SocketRing]:
    store = dist.HashStore()
    made: dict[int, SocketRing | BaseException] = {}

    def make(rank: int) -> None:
        try:
            made[rank] = SocketRing(store=store, rank=rank, world_size=n, host="127.0.0.1", timeout_s=timeout_s)
        except BaseException as e:  # noqa: BLE001 - surfaced below
            made[rank] = e

    threads = [threading.Thread(target=make, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    for r in range(n):
        if isinstance(made[r], BaseException):
            raise made[r]
    return [made[r] for r in range(n)]


def on_every_rank(rings: list[SocketRing], body) -> list:
    """``body(rank, ring)`` on a thread per rank, at once; their results (an exception re-raised)."""
    results: dict[int, object] = {}

    def run(r: int) -> None:
        try:
            results[r] = body(r, rings[r])
        except BaseException as e:  # noqa: BLE001 - surfaced below
            results[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(rings))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 2)
    for r in range(len(rings)):
        if isinstance(results[r], BaseException):
            raise results[r]
    return [results[r] for r in range(len(rings))]


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_ring_sums_every_tensor_in_place_in_the_order_handed_over(n, dtype):
    torch.manual_seed(n)
    # shapes whose total does not divide by n, a scalar, a non-contiguous gradient (a transposed weight)
    values = [[torch.randn(shape).to(dtype) for shape in ((7, 3), (), (5,), (4, 6))] for _ in range(n)]
    values_2 = [[torch.randn(11).to(dtype)] for _ in range(n)]
    rings = ring(n)
    try:

        def body(rank: int, r: SocketRing):
            mine = [v.clone() for v in values[rank]]
            mine[3] = mine[3].t().contiguous().t()  # same values, transposed layout
            second = [v.clone() for v in values_2[rank]]
            first = r.all_reduce_sum(mine)
            later = r.all_reduce_sum(second)  # handed over before the first is waited for
            assert not first.done()
            later.wait(TIMEOUT_S)  # runs the first one too, in order
            assert first.done()
            first.wait(TIMEOUT_S)
            return mine, second

        results = on_every_rank(rings, body)
    finally:
        for r in rings:
            r.close()
    tolerance = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-6}
    expected = [sum(v[i].double() for v in values) for i in range(4)]
    expected_2 = sum(v[0].double() for v in values_2)
    for mine, second in results:
        for got, want in zip(mine, expected):
            assert got.dtype == dtype
            torch.testing.assert_close(got.double(), want, **tolerance)
        torch.testing.assert_close(second[0].double(), expected_2, **tolerance)
    for i in range(4):  # every replica ends with the same bits
        assert all(torch.equal(results[0][0][i], res[0][i]) for res in results)


def test_a_replica_that_never_joins_fails_the_all_reduce_in_time_and_every_later_one():
    rings = ring(3, timeout_s=5.0)
    try:

        def body(rank: int, r: SocketRing):
            if rank == 2:
                return None  # never reduces
            started = time.monotonic()
            handle = r.all_reduce_sum([torch.ones(1000)])
            with pytest.raises(DataPlaneError, match="timed out"):
                handle.wait(1.0)
            waited = time.monotonic() - started
            with pytest.raises(DataPlaneError, match="failed earlier"):
                r.all_reduce_sum([torch.ones(3)]).wait(1.0)
            return waited

        waited = on_every_rank(rings, body)
    finally:
        for r in rings:
            r.close()
    assert all(w < 4.0 for w in waited[:2])


def test_closing_a_ring_ends_a_wait_at_once():
    rings = ring(2)
    try:
        handle = rings[0].all_reduce_sum([torch.ones(10)])
        threading.Timer(0.5, rings[0].close).start()
        started = time.monotonic()
        with pytest.raises(DataPlaneError):
            handle.wait(TIMEOUT_S)
        assert time.monotonic() - started < TIMEOUT_S / 2
    finally:
        for r in rings:
            r.close()
