"""A worker's value server (atoll.worker.values) on a real socket: whole values, a data-parallel
replica's rows alone, and clear errors for a bad token or a malformed request."""

import json
import socket

import pytest
import torch

from atoll.core.wire import replica_rows
from atoll.errors import InvalidInput, NotFound, Unauthenticated
from atoll.net import address
from atoll.worker.values import ValueStore, pull

TOKEN = "secret"


@pytest.fixture
def store():
    s = ValueStore("127.0.0.1", TOKEN)
    s.put("batch", torch.arange(24.0).reshape(6, 4))
    yield s
    s.close()


def test_a_replica_pulls_its_rows_alone(store):
    whole = pull(store.address, TOKEN, "batch", 10.0)
    assert torch.equal(whole, torch.arange(24.0).reshape(6, 4)) and store.bytes_served == whole.nbytes
    for index in range(3):
        rows = pull(store.address, TOKEN, "batch", 10.0, (index, 3))
        assert torch.equal(rows, replica_rows(whole, index, 3)) and rows.shape == (2, 4)
    assert store.bytes_served == 2 * whole.nbytes  # the three replicas' rows: the value once more
    assert torch.equal(store.get("batch", (1, 2)), whole[3:])  # read in place, the same rows


def _ask(store, line: str) -> dict:
    with socket.create_connection(address.split(store.address), timeout=10.0) as conn:
        conn.sendall(line.encode() + b"\n")
        return json.loads(conn.makefile("rb").readline())


@pytest.mark.parametrize(
    "line, error",
    [
        (f"{TOKEN} batch 1-2", "malformed rows '1-2'"),
        (f"{TOKEN} batch 2/2", "rows 2/2 out of range"),
        (f"{TOKEN} batch 0/0", "rows 0/0 out of range"),
        (f"{TOKEN} missing", "not on this worker"),
        ("wrong batch", "bad token"),
    ],
)
def test_a_bad_request_gets_the_reason_and_the_server_serves_on(store, line, error):
    assert error in _ask(store, line)["error"]
    assert pull(store.address, TOKEN, "batch", 10.0, (1, 2)).shape == (3, 4)


@pytest.mark.parametrize(
    "token, value_id, rows, error, reason",
    [
        ("wrong", "batch", (0, 1), Unauthenticated, "bad token"),
        (TOKEN, "missing", (0, 1), NotFound, "not on this worker"),
        (TOKEN, "batch", (3, 2), InvalidInput, "rows 3/2 out of range"),
    ],
)
def test_pull_raises_the_servers_reason_as_its_kind(store, token, value_id, rows, error, reason):
    with pytest.raises(error, match=reason):
        pull(store.address, token, value_id, 10.0, rows)
    assert pull(store.address, TOKEN, "batch", 10.0).shape == (6, 4)  # it serves on
