"""The data plane's rendezvous lives behind the controller's gRPC (controller/cluster/rendezvous.py): the
controller listens on no other port, and its store can be neither read nor written without the
cluster token and the job's namespace secret, which only the job's workers get."""

from pathlib import Path

import grpc
import pytest

from atoll._rpc import atoll_pb2 as pb
from atoll._rpc import atoll_pb2_grpc as pb_grpc
from atoll.controller.cluster.rendezvous import MAX_VALUE_BYTES, Rendezvous
from atoll.errors import InvalidInput, NotPermitted
from atoll.net.auth import call_metadata
from tests import models

pytestmark = pytest.mark.cluster  # every test here starts processes


def _listening_ports(pid: int) -> set[int]:
    """TCP ports the process listens on, from /proc (its sockets' inodes in the listening table)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_the_store_refuses_whoever_lacks_the_token_or_the_job_secret(cluster4, client4):
    assert _listening_ports(cluster4.controller.pid) == {int(cluster4.address.rsplit(":", 1)[1])}

    model, batches, loss_fn = models.mlp()
    x, y = batches[0]
    job = client4.pipeline(model, example_input=x, example_target=y, loss_fn=loss_fn, stages=2, microbatches=2)
    first = job.step(x, y)
    namespace = job.plan.report["rendezvous"]
    channel = grpc.insecure_channel(cluster4.address)
    stub = pb_grpc.ControllerStub(channel)
    with_token = call_metadata(cluster4.token)
    try:
        tries = (("get", ["0"], b""), ("check", ["0", "1"], b""), ("set", ["0"], b"x"), ("add", ["n"], b""))
        for op, keys, value in tries:
            request = pb.RendezvousRequest(namespace=namespace, secret="0" * 32, op=op, keys=keys, value=value)
            with pytest.raises(grpc.RpcError) as no_token:
                stub.Rendezvous(request, timeout=10)
            assert no_token.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as no_secret:
                stub.Rendezvous(request, timeout=10, metadata=with_token)
            assert no_secret.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "the secret is wrong" in no_secret.value.details()
    finally:
        channel.close()
    assert job.step(x, y) != first  # the job, whose store was tried, trains on
    job.close()


def test_the_rendezvous_store_keeps_namespaces_apart_and_bounds_what_it_holds():
    store = Rendezvous()
    secret = store.open("job0.a")

    def call(op, keys, secret=secret, **fields):
        return store.serve(pb.RendezvousRequest(namespace="job0.a", secret=secret, op=op, keys=keys, **fields))

    assert not call("get", ["k"], wait_s=0.05).ready  # not there yet: a waiting get answers "not ready"
    call("set", ["k"], value=b"v")
    assert call("get", ["k"], wait_s=5).value == b"v"
    assert call("add", ["n"], amount=2).number == 2 and call("add", ["n"], amount=3).number == 5
    assert call("check", ["k", "n"]).ready and not call("check", ["k", "missing"]).ready
    assert call("delete", ["k"]).ready and not call("check", ["k"]).ready
    with pytest.raises(NotPermitted, match="the secret is wrong"):
        call("get", ["n"], secret=secret[:-1] + "x")
    with pytest.raises(InvalidInput, match="at most 1048576 bytes"):
        call("set", ["big"], value=b"x" * (MAX_VALUE_BYTES + 1))
    with pytest.raises(InvalidInput, match="unknown rendezvous operation"):
        call("list", ["k"])
    with pytest.raises(InvalidInput, match="does not hold a counter"):
        call("set", ["t"], value=b"text") and call("add", ["t"], amount=1)
    store.close("job0.a")
    with pytest.raises(NotPermitted):
        call("check", ["n"])
