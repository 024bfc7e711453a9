"""Every process a LocalCluster starts is stopped by PID, on a clean exit and on an error."""

import os
import shutil

import pytest

import atoll
from tests.procs import alive, descendants

pytestmark = pytest.mark.cluster  # every test here starts processes


def test_local_cluster_stops_everything_it_started():
    before = set(descendants(os.getpid()))
    with atoll.LocalCluster(workers=2) as cluster:
        pids = cluster.pids
        assert len(pids) == 3 and all(alive(p) for p in pids)
        started = set(descendants(os.getpid())) - before
        assert set(pids) <= started  # and, on Linux, the zygote they were forked from
        with cluster.client() as client:
            assert sum(w.alive for w in client.status().workers) == 2
    assert not any(alive(p) for p in pids)
    assert not any(alive(p) for p in started)
    assert not cluster.log_dir.exists()  # a clean exit: every daemon exited 0 on SIGTERM


def test_local_cluster_stops_everything_when_the_body_raises(capfd):
    """... and keeps its logs, saying where (a clean exit removes them, as the test above shows)."""
    before = set(descendants(os.getpid()))
    with pytest.raises(RuntimeError, match="boom"):
        with atoll.LocalCluster(workers=1) as cluster:
            pids = set(descendants(os.getpid())) - before
            raise RuntimeError("boom")
    assert set(cluster.pids) <= pids
    assert not any(alive(p) for p in pids)
    try:
        assert (cluster.log_dir / "controller.log").is_file() and (cluster.log_dir / "worker0.log").is_file()
        (line,) = [x for x in capfd.readouterr().err.splitlines() if "LocalCluster" in x]
        assert line.endswith(f"its logs are kept in {cluster.log_dir}"), line
    finally:
        shutil.rmtree(cluster.log_dir, ignore_errors=True)
