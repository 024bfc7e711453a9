import os
import signal
import tempfile

import pytest

import atoll
from tests.procs import alive, descendants


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
