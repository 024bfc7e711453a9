"""Every process a LocalCluster starts is stopped by PID, on a clean exit and on an error."""

import os

import pytest

import atoll
from tests.procs import alive, descendants


def test_local_cluster_stops_everything_it_started():
    with atoll.LocalCluster(workers=2) as cluster:
        pids = cluster.pids
        assert len(pids) == 3 and all(alive(p) for p in pids)
        assert set(pids) <= set(descendants(os.getpid()))
        with cluster.client() as client:
            assert sum(w.alive for w in client.status().workers) == 2
    assert not any(alive(p) for p in pids)


def test_local_cluster_stops_everything_when_the_body_raises():
    with pytest.raises(RuntimeError, match="boom"):
        with atoll.LocalCluster(workers=1) as cluster:
            pids = cluster.pids
            raise RuntimeError("boom")
    assert not any(alive(p) for p in pids)
