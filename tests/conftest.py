import os
import signal
import tempfile

import pytest

import atoll
from tests.procs import alive, descendants

# Fixtures that start daemons: a test that asks for one is a `cluster` test without saying so.
CLUSTER_FIXTURES = {"cluster4", "client4", "gpipe_run", "islands_cluster", "gpu_client"}


def pytest_collection_modifyitems(items):
    for item in items:
        if CLUSTER_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.cluster)


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
def no_stray_processes():
    """Fails the run if any process started by the suite outlives it (and stops it)."""
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
