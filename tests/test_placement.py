"""Placement as pure logic: islands, load, exclusive jobs, all or nothing."""

import pytest

from atoll.controller.cluster.placement import place
from atoll.controller.cluster.registry import WorkerRecord
from atoll.errors import NotEnoughWorkers


def _workers(*islands: str, jobs: dict[int, set[str]] | None = None) -> list[WorkerRecord]:
    out = []
    for i, island in enumerate(islands):
        w = WorkerRecord(f"w{i}", f"127.0.0.1:{i}", "cpu", "h", 1, "", None, island=island)
        w.jobs = set((jobs or {}).get(i, set()))
        out.append(w)
    return out


def _ids(ws) -> list[str]:
    return [w.worker_id for w in ws]


def test_bound_ranks_get_their_island_and_unbound_ranks_take_the_least_loaded_rest():
    live = _workers("a", "a", "b", jobs={0: {"j"}})
    # rank 1 is bound to "a": it takes w1 (w0 is busier), so the unbound rank 0 takes w2 on "b"
    assert _ids(place(live, set(), 2, "cpu", ("", "a"))) == ["w2", "w1"]
    assert _ids(place(live, set(), 3, "cpu")) == ["w1", "w2", "w0"]


def test_exclusive_jobs_take_idle_workers_and_keep_them():
    live = _workers("a", "a", "a", jobs={0: {"mine"}, 1: {"shared"}})
    assert _ids(place(live, set(), 1, "cpu", exclusive=True)) == ["w2"]
    assert _ids(place(live, {"mine"}, 2, "cpu")) == ["w2", "w1"]  # w0 is held by an exclusive job
    with pytest.raises(NotEnoughWorkers, match="needs 2 idle workers of device kind 'cpu' but 1 are free"):
        place(live, set(), 2, "cpu", exclusive=True)


def test_a_request_that_cannot_be_met_whole_names_what_was_asked_and_what_exists():
    live = _workers("a", "b")
    with pytest.raises(NotEnoughWorkers, match=r"\(2 on a\) but the live ones are: 1 on a, 1 on b"):
        place(live, set(), 2, "cpu", ("a", "a"))
    with pytest.raises(NotEnoughWorkers, match="needs 3 workers .* but 2 are alive"):
        place(live, set(), 3, "cpu")
    with pytest.raises(NotEnoughWorkers, match="needs 1 workers of device kind 'cuda' .* but 0 are alive"):
        place(live, set(), 1, "cuda")
