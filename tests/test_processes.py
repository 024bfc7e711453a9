"""Every process a LocalCluster starts is stopped by PID, on a clean exit and on an error."""

import ctypes
import os
import shutil
import signal
import sys
import time

import pytest

import atoll
from atoll.client.zygote import shared, unshared, zygote_for
from tests.procs import alive, descendants

pytestmark = pytest.mark.cluster  # every test here starts processes


@pytest.fixture(autouse=True)
def own_zygote():
    """Each cluster here starts its own zygote (not the suite's shared one), which it must stop too."""
    with unshared():
        yield


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


def test_clusters_in_a_shared_block_fork_from_one_zygote_that_the_block_stops(tmp_path):
    before = set(descendants(os.getpid()))
    with shared(tmp_path):
        with atoll.LocalCluster(workers=1) as first:
            zygote = first._zygote.pid
            assert set(first.pids) <= set(descendants(zygote))
        assert alive(zygote) and not any(alive(p) for p in first.pids)  # the cluster stopped its daemons only
        with atoll.LocalCluster(workers=2) as second, second.client() as client:
            assert second._zygote.pid == zygote and set(second.pids) <= set(descendants(zygote))
            assert sum(w.alive for w in client.status().workers) == 2
    assert not any(alive(p) for p in set(descendants(os.getpid())) - before)  # the zygote too


def test_a_shared_zygote_is_one_per_start_environment_but_for_the_ignored_variables(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with shared(tmp_path, ignore={"NAMES_THE_TEST"}):
        zygote, owned = zygote_for(env, tmp_path, 60)
        assert not owned and zygote.running
        assert zygote_for(dict(env, NAMES_THE_TEST="b"), tmp_path, 60)[0] is zygote
        other, _ = zygote_for(dict(env, GLIBC_TUNABLES="glibc.malloc.arena_max=1"), tmp_path, 60)
        assert other is not zygote and other.running  # its daemons would run with other malloc settings
    assert not zygote.running and not other.running
    own, owned = zygote_for(env, tmp_path, 60)  # no shared block open: the caller's own, to close
    try:
        assert owned and own.running and (tmp_path / "zygote.log").is_file()
    finally:
        own.close()


def test_only_a_cpu_cluster_forks_its_daemons_from_a_zygote():
    """A child forked after its parent touched CUDA cannot use CUDA (on a GPU machine, every CUDA
    worker forked from the zygote died at start: "Cannot re-initialize CUDA in forked subprocess")."""
    assert atoll.LocalCluster(workers=2)._forks_daemons() == sys.platform.startswith("linux")
    assert not atoll.LocalCluster(workers=2, devices=["cpu", "cuda:0"], cuda_mps=False)._forks_daemons()


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


SYS_TGKILL = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)


@pytest.mark.skipif(not sys.platform.startswith("linux") or SYS_TGKILL is None, reason="tgkill: Linux x86-64/arm64")
def test_a_daemon_stops_on_a_sigterm_that_another_of_its_threads_took():
    """The kernel may hand a process's SIGTERM to any thread; CPython only runs the handler on
    the main thread, which must wake for it (CUDA workers on an H100 did not, until SIGKILL).
    Here the signal goes to one of each daemon's other threads on purpose (tgkill)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with atoll.LocalCluster(workers=1, threads_per_worker=1) as cluster:
        daemons = [cluster.workers[0], cluster.controller]
        for proc in daemons:
            others = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid]
            assert others, "a daemon serves gRPC from threads of its own"
            assert libc.syscall(SYS_TGKILL, proc.pid, others[-1], signal.SIGTERM) == 0, ctypes.get_errno()
        deadline = time.monotonic() + 20
        while any(p.poll() is None for p in daemons) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p.poll() for p in daemons] == [0, 0]  # a clean stop, not the cluster's SIGKILL
