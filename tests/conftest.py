import fcntl
import os
import signal
import tempfile
from contextlib import contextmanager

import pytest

import atoll
from atoll.client.zygote import shared as shared_zygotes
from tests.procs import alive, descendants

# Fixtures that start daemons: a test that asks for one is a `cluster` test without saying so.
CLUSTER_FIXTURES = {"cluster4", "client4", "gpipe_run", "islands_cluster", "gpu_client"}


def pytest_collection_modifyitems(items):
    for item in items:
        if CLUSTER_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.cluster)

    # `alone` tests first: under pytest-xdist they then run while the other pytest worker holds the
    # least memory (no shared cluster started yet, few modules imported); test_large_model's
    # controller was OOM-killed in 3 of 6 full runs when it came later (about 11 GB beside the test's 6).
    # Then the tests that start no process: the other pytest worker runs them meanwhile instead of
    # waiting (about 75 s) for the `alone` test to give the cluster lock back.
    def order(item):
        return item.get_closest_marker("alone") is None, item.get_closest_marker("cluster") is not None

    items.sort(key=order)


@contextmanager
def _flock(path, mode: int):
    with open(path, "a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def alone_tests_have_the_machine(request, tmp_path_factory):
    """Under pytest-xdist (the README's `-n 2`), a test marked `alone` runs while no other
    cluster test runs: test_large_model needs about 16 GiB, and a cluster beside it once got the
    controller OOM-killed. Cluster tests share a lock that an `alone` test takes exclusively;
    the gate in front of it stops new sharers while an `alone` test waits, so it is not starved."""
    alone = request.node.get_closest_marker("alone") is not None
    if "PYTEST_XDIST_WORKER" not in os.environ or not (alone or request.node.get_closest_marker("cluster")):
        yield
        return
    run = tmp_path_factory.getbasetemp().parent  # shared by this run's xdist workers
    gate, lock = run / "atoll-alone.gate", run / "atoll-alone.lock"
    if alone:
        with _flock(gate, fcntl.LOCK_EX), _flock(lock, fcntl.LOCK_EX):
            yield
        return
    with _flock(gate, fcntl.LOCK_EX):
        shared = open(lock, "a")
        fcntl.flock(shared, fcntl.LOCK_SH)
    try:
        yield
    finally:
        fcntl.flock(shared, fcntl.LOCK_UN)
        shared.close()


def _children_cpu_s() -> float:
    times = os.times()
    return times.children_user + times.children_system


@pytest.fixture(autouse=True)
def only_cluster_tests_start_processes(request):
    """Keeps the inner loop (`pytest -m "not cluster"`) honest: a test without the `cluster`
    marker that starts a process (one that ran and was reaped, or one still running) fails."""
    if request.node.get_closest_marker("cluster"):
        yield
        return
    cpu, running = _children_cpu_s(), set(descendants(os.getpid()))
    yield
    started = set(descendants(os.getpid())) - running
    assert _children_cpu_s() == cpu and not started, (
        f"{request.node.nodeid} starts processes: mark it `@pytest.mark.cluster` (or its module's pytestmark)"
    )


@pytest.fixture(scope="session", autouse=True)
def no_stray_processes(tmp_path_factory):
    """Fails the run if any process started by the suite outlives it (and stops it). Meanwhile the
    LocalClusters of each pytest process fork their daemons from one shared zygote (about 4.6 s of
    CPU per cluster saved: atoll.client.zygote.shared), closed before the check. pytest names the
    running test in the environment, which is no reason for a zygote of its own."""
    with shared_zygotes(tmp_path_factory.mktemp("zygotes"), ignore={"PYTEST_CURRENT_TEST"}):
        yield
    leftover = [pid for pid in descendants(os.getpid()) if alive(pid)]
    for pid in leftover:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not leftover, f"processes started by the test suite outlived it: {leftover}"


@pytest.fixture(scope="session", autouse=True)
def temporary_files_in_pytests_tree(tmp_path_factory):
    """A LocalCluster keeps its logs when a daemon died, which several tests cause on purpose:
    its temporary folders go under pytest's own temporary tree (pruned to the last 3 runs), not
    /tmp."""
    before = tempfile.tempdir
    tempfile.tempdir = str(tmp_path_factory.mktemp("tmp"))
    yield
    tempfile.tempdir = before


@pytest.fixture(scope="session")
def cluster4():
    """One 4-worker local cluster shared by the tests that only submit jobs to it."""
    with atoll.LocalCluster(workers=4) as cluster:
        yield cluster


@pytest.fixture()
def client4(cluster4):
    with cluster4.client() as client:
        yield client
