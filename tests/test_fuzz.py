"""Bad input never crashes a daemon: random bytes, random messages of each request type (extreme
numbers, unknown enum values and strings, huge shapes) and mutated (bit-flipped, truncated) valid
ones go to every RPC of the controller and of a worker, with and without the token. Every reply
is a gRPC status or a reply, the daemons stay up with their memory where it was (10%), and a
normal job trains afterwards."""

import random
import time

import grpc
import pytest
from google.protobuf import descriptor as pd
from grpc_health.v1 import health_pb2

import atoll
from atoll._rpc import atoll_pb2 as pb
from atoll.controller.statedir import StateDir
from atoll.net.auth import call_metadata
from tests import models
from tests.procs import health, rss

pytestmark = pytest.mark.cluster  # every test here starts processes

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

EXAMPLES_PER_RPC = 60  # each sent with and without the token: 120 messages per RPC
DEAD = (grpc.StatusCode.UNAVAILABLE,)  # what a crashed or hung daemon looks like to a caller (then checked)


INTS = st.one_of(st.integers(-3, 3), st.sampled_from([2**31 - 1, -(2**31), 2**40, 2**62]), st.integers(0, 64))


def _scalar(field: pd.FieldDescriptor):
    t = field.type
    if t in (pd.FieldDescriptor.TYPE_DOUBLE, pd.FieldDescriptor.TYPE_FLOAT):
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if t == pd.FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == pd.FieldDescriptor.TYPE_STRING:
        return st.one_of(st.text(max_size=12), st.sampled_from(["job0", "float32", "cpu", "F", "gpipe", "x" * 300]))
    if t == pd.FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == pd.FieldDescriptor.TYPE_ENUM:
        return st.integers(-1, 40)  # unknown values included
    if t in (pd.FieldDescriptor.TYPE_UINT32, pd.FieldDescriptor.TYPE_UINT64):
        return st.one_of(st.integers(0, 64), st.sampled_from([2**32 - 1, 2**40]))
    if t in (pd.FieldDescriptor.TYPE_INT32, pd.FieldDescriptor.TYPE_SINT32):
        return st.one_of(st.integers(-3, 64), st.sampled_from([2**31 - 1, -(2**31)]))
    return INTS


def _message(desc: pd.Descriptor, depth: int = 0):
    """A strategy for messages of ``desc``: any subset of its fields, with hostile values."""
    if desc.full_name.startswith("google.protobuf") or depth > 3:
        return st.just(None)
    fields = {}
    for f in desc.fields:
        if f.type == pd.FieldDescriptor.TYPE_MESSAGE:
            if f.message_type.GetOptions().map_entry:
                continue
            one = _message(f.message_type, depth + 1)
        else:
            one = _scalar(f)
        fields[f.name] = st.lists(one, max_size=3) if f.is_repeated else one

    @st.composite
    def build(draw):
        msg = _class(desc)()
        for name in draw(st.lists(st.sampled_from(sorted(fields)), unique=True)) if fields else []:
            value = draw(fields[name])
            f = desc.fields_by_name[name]
            try:
                if f.is_repeated:
                    target = getattr(msg, name)
                    for v in value:
                        target.add().CopyFrom(v) if f.type == pd.FieldDescriptor.TYPE_MESSAGE and v else (
                            target.append(v) if f.type != pd.FieldDescriptor.TYPE_MESSAGE else None
                        )
                elif f.type == pd.FieldDescriptor.TYPE_MESSAGE:
                    if value is not None:
                        getattr(msg, name).CopyFrom(value)
                else:
                    setattr(msg, name, value)
            except (ValueError, TypeError):
                pass  # a value the field cannot hold (protobuf refuses it on our side)
        return msg

    return build()


def _class(desc: pd.Descriptor):
    return getattr(pb, desc.name)


def _mutate(data: bytes, rnd: random.Random) -> bytes:
    data = bytearray(data)
    for _ in range(rnd.randint(1, 4)):
        choice = rnd.random()
        if data and choice < 0.4:
            data[rnd.randrange(len(data))] ^= 1 << rnd.randrange(8)
        elif data and choice < 0.7:
            del data[rnd.randrange(len(data)) :]
        else:
            data[rnd.randrange(len(data) + 1) : 0] = rnd.randbytes(rnd.randint(1, 8))
    return bytes(data)


def _payloads(desc: pd.Descriptor):
    msg = _message(desc)
    return st.one_of(
        st.binary(max_size=256),  # random bytes: mostly not a valid message
        msg.map(lambda m: m.SerializeToString()),
        st.tuples(msg, st.randoms()).map(lambda t: _mutate(t[0].SerializeToString(), t[1])),
    )


def _methods(service: str):
    return [(service, m) for m in pb.DESCRIPTOR.services_by_name[service].methods]


def _send(channel, service: str, method, data: bytes, token: str | None) -> grpc.StatusCode:
    path = f"/{pb.DESCRIPTOR.package}.{service}/{method.name}"
    metadata = call_metadata(token) if token else None
    try:
        if method.client_streaming:  # the payload as a stream of two messages
            for _ in channel.stream_stream(path)(iter([data, data]), timeout=20, metadata=metadata):
                pass
        elif method.server_streaming:
            for _ in channel.unary_stream(path)(data, timeout=20, metadata=metadata):
                pass
        else:
            channel.unary_unary(path)(data, timeout=20, metadata=metadata)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def _serving(channel) -> bool:
    """The daemon answers grpc_health_probe's question with SERVING."""
    try:
        return health(channel) == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _fuzzer(channel, service: str, method, token: str, counts: dict):
    """A hypothesis test sending ``method`` hostile payloads, each without and with the token."""

    @hypothesis.settings(
        max_examples=EXAMPLES_PER_RPC, deadline=None, derandomize=True, database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )  # fmt: skip
    @hypothesis.given(data=_payloads(method.input_type))
    def fuzz(data):
        for with_token in (False, True):
            code = _send(channel, service, method, data, token if with_token else None)
            counts[code] = counts.get(code, 0) + 1
            # UNAVAILABLE may be relayed from behind the daemon (PutValue to a worker a fuzzed
            # RegisterWorker made up): the daemon itself must still answer its health check
            assert code not in DEAD or _serving(channel), f"{service}.{method.name} left the daemon unreachable: {code}"
            if not with_token:
                assert code == grpc.StatusCode.UNAUTHENTICATED, (service, method.name, code)

    return fuzz


@pytest.fixture(scope="module")
def fuzz_cluster(tmp_path_factory):
    # with a state directory: the fuzzed calls must not corrupt what a restart would read
    with atoll.LocalCluster(workers=2, state_dir=tmp_path_factory.mktemp("state")) as cluster:
        yield cluster


def _train_once(client) -> float:
    model, batches, loss_fn = models.mlp()
    x, y = batches[0]
    with client.pipeline(model, example_input=x, example_target=y, loss_fn=loss_fn, stages=2, microbatches=2) as job:
        return job.step(x, y)


@pytest.mark.timeout(900)
def test_hostile_messages_to_every_rpc_crash_no_daemon(fuzz_cluster):
    cluster = fuzz_cluster
    with cluster.client() as client:
        _train_once(client)  # warm: torch and gloo loaded, a plan compiled
        workers = client.status().workers
    pids = {"controller": cluster.controller.pid, **{w.worker_id: w.pid for w in workers}}
    before = {name: rss(pid) for name, pid in pids.items()}
    targets = {"Controller": cluster.address, "Worker": workers[0].address}
    counts: dict = {}
    for service, address in targets.items():
        channel = grpc.insecure_channel(address)
        for _, method in _methods(service):
            _fuzzer(channel, service, method, cluster.token, counts)()
        channel.close()
    sent = sum(counts.values())
    assert sent >= 2000 and sent >= 2 * EXAMPLES_PER_RPC * (len(_methods("Controller")) + len(_methods("Worker")))
    assert all(p.poll() is None for p in [cluster.controller, *cluster.workers]), "a daemon exited"
    with cluster.client() as client:
        # workers a fuzzed RegisterWorker made up never heartbeat: wait until they are declared dead
        deadline = time.monotonic() + 3 * cluster.heartbeat_timeout_s
        while sum(w.alive for w in client.status().workers) > len(workers) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _train_once(client) > 0  # the cluster still trains
    recorded = StateDir(cluster.state_dir).read()  # what a restart would read: still whole
    assert {w.worker_id for w in workers} <= {w.worker_id for w in recorded.workers if w.alive}
    after = {name: rss(pid) for name, pid in pids.items()}
    for name in pids:
        assert after[name] <= 1.1 * before[name], (name, before[name], after[name], counts)
