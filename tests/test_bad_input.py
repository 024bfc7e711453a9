"""Bad input gets a clear error, and the daemons keep serving afterwards."""

import io
import zipfile

import grpc
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import atoll
from atoll._rpc import atoll_pb2 as pb
from atoll.client.export import export_pipeline
from atoll.core.config import JobConfig
from atoll.core.graphs import FORCE_WEIGHTS_ONLY_ENV, deserialize
from atoll.core.mesh import Mesh
from atoll.core.wire import spec_to_pb
from atoll.net.auth import call_metadata
from tests import models

pytestmark = pytest.mark.cluster  # every test here starts processes


@pytest.fixture(scope="module")
def mlp_job(cluster4):
    with cluster4.client() as client:
        job, _, batches, _ = models.submit(client, stages=4, microbatches=4, optimizer_args={"lr": 0.01})
        yield job, *batches[0]
        job.close()


def still_serving(job, x, y):
    loss = job.step(x, y)
    assert loss == loss and loss > 0


def test_wrong_input_shape_names_edge_and_shapes(mlp_job):
    job, x, y = mlp_job
    with pytest.raises(atoll.InvalidInput) as err:
        job.step(x[:30], y)
    message = str(err.value)
    assert "edge 'input'" in message
    assert "expected float32[32, 16]" in message and "received float32[30, 16]" in message
    still_serving(job, x, y)


def test_wrong_target_dtype_names_edge(mlp_job):
    job, x, y = mlp_job
    expected = r"edge 'target': expected float32\[32, 4\], received float64\[32, 4\]"
    with pytest.raises(atoll.InvalidInput, match=expected):
        job.step(x, y.double())
    still_serving(job, x, y)


def test_wrong_token_is_rejected_before_deserializing(cluster4, mlp_job):
    job, x, y = mlp_job
    channel = grpc.insecure_channel(cluster4.address)
    garbage = b"\xff\xfe not a protobuf \x00" * 10
    raw = channel.unary_unary("/atoll.v1.Controller/Step", request_serializer=None, response_deserializer=None)
    # a wrong token with an unparseable body: UNAUTHENTICATED (a parse attempt would say INTERNAL)
    with pytest.raises(grpc.RpcError) as err:
        raw(garbage, metadata=call_metadata("not-the-token"), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        raw(garbage, timeout=10)  # no token at all
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # the same garbage with the right token does get parsed, and fails as malformed
    with pytest.raises(grpc.RpcError) as err:
        raw(garbage, metadata=call_metadata(cluster4.token), timeout=10)
    assert err.value.code() != grpc.StatusCode.UNAUTHENTICATED
    channel.close()
    with pytest.raises(atoll.Unauthenticated, match="token"):  # at once, not at the first call
        atoll.connect(cluster4.address, token="wrong")
    still_serving(job, x, y)


def test_workers_also_require_the_token(cluster4):
    with cluster4.client() as client:
        worker = client.status().workers[0]
    channel = grpc.insecure_channel(worker.address)
    ping = channel.unary_unary("/atoll.v1.Worker/Ping", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as err:
        ping(b"", metadata=call_metadata("wrong"), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert ping(b"", metadata=call_metadata(cluster4.token), timeout=10) == b""
    channel.close()


def test_more_stages_than_live_workers(client4, mlp_job):
    with pytest.raises(atoll.NotEnoughWorkers, match=r"needs 5 workers .* but 4 are alive"):
        models.submit(client4, stages=5, microbatches=4)
    still_serving(*mlp_job)


def test_unknown_job_id(client4, mlp_job):
    with pytest.raises(atoll.NotFound, match="unknown job 'no-such-job'"):
        client4.job("no-such-job")
    with pytest.raises(atoll.NotFound, match="unknown job"):
        client4._call("Step", pb.StepRequest(job_id="no-such-job"))
    still_serving(*mlp_job)


def test_closed_job(client4, mlp_job):
    job, _, batches, _ = models.submit(client4, stages=2, microbatches=2)
    x, y = batches[0]
    job.step(x, y)
    job.close()
    job.close()  # closing twice is fine
    with pytest.raises(atoll.NotFound, match=f"job '{job.id}' was closed"):
        job.step(x, y)
    assert job.id not in [j.job_id for j in client4.status().jobs]
    assert all(job.id not in w.jobs for w in client4.status().workers)
    still_serving(*mlp_job)


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) if x.sum() > 0 else -x  # control flow on values: torch.export refuses


def test_model_that_cannot_be_split(client4, mlp_job):
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def pipeline(model, **kw):
        return client4.pipeline(model, example_input=x, example_target=y, loss_fn=F.mse_loss, microbatches=2, **kw)

    with pytest.raises(atoll.InvalidInput, match="cannot split a model of 1 operations into 2 stages"):
        pipeline(nn.ReLU(), stages=2)
    with pytest.raises(atoll.InvalidInput, match=r"torch.export failed for the model \(_DataDependent\)"):
        pipeline(_DataDependent(), stages=2)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 8))
    with pytest.raises(atoll.InvalidInput, match=r"split point '1.5' names no module .* \(modules include: 0, 1, 1.0"):
        pipeline(model, stages=2, split_points=["1.5"])
    with pytest.raises(atoll.InvalidInput, match="in the order the forward runs them"):
        pipeline(model, stages=3, split_points=["2", "1"])
    with pytest.raises(atoll.InvalidInput, match="in the order the forward runs them"):
        pipeline(model, stages=2, split_points=["0"])  # stage 0 would be empty
    with pytest.raises(atoll.InvalidInput, match="3 stages need 2 split points, got 1"):
        pipeline(model, stages=3, split_points=["1"])
    with pytest.raises(atoll.InvalidInput, match="split point 7 is not a child index in 1..2"):
        pipeline(model, stages=2, split_points=[7])
    still_serving(*mlp_job)


def test_bad_arguments_are_refused_by_name(client4, mlp_job):
    def submit(**kw):
        return models.submit(client4, **{"stages": 2, "microbatches": 4, **kw})

    with pytest.raises(atoll.InvalidInput, match="unknown schedule 'zigzag'"):
        submit(schedule="zigzag")
    with pytest.raises(atoll.InvalidInput, match="unknown optimizer 'lion'"):
        submit(optimizer="lion")
    with pytest.raises(atoll.InvalidInput, match="takes no argument 'learning_rate'"):
        submit(optimizer="sgd", optimizer_args={"learning_rate": 0.1})
    with pytest.raises(atoll.InvalidInput, match="not divisible into 5 microbatches"):
        submit(microbatches=5)
    still_serving(*mlp_job)


def _program(exported, **overrides) -> pb.PipelineProgram:
    program = pb.PipelineProgram(
        model_program=exported.model,
        loss_program=exported.loss,
        config=JobConfig(stages=2, microbatches=2).to_pb(),
        input=spec_to_pb(exported.input),
        target=spec_to_pb(exported.target),
    )
    for key, value in overrides.items():
        setattr(program, key, value) if not isinstance(value, list) else getattr(program, key).extend(value)
    return program


def _small_export():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    return export_pipeline(model, torch.randn(4, 4), torch.randn(4, 4), F.mse_loss, 2)


def test_malformed_program_is_refused(client4, mlp_job):
    exported = _small_export()
    program = _program(exported)
    program.model_program = b"this is not an archive"
    with pytest.raises(atoll.InvalidInput, match=r"model program: not a loadable torch.export archive"):
        client4._call("SubmitPipeline", program)
    still_serving(*mlp_job)


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _poisoned(archive: bytes, marker: str) -> bytes:
    """The same export archive, with a pickle that would create ``marker`` when unpickled."""
    src, out = zipfile.ZipFile(io.BytesIO(archive)), io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("sample_inputs/model.pt"):
                buf = io.BytesIO()
                torch.save({"evil": _Evil(marker)}, buf)
                data = buf.getvalue()
            dst.writestr(info, data)
    return out.getvalue()


def test_pickled_code_is_never_run(cluster4, client4, tmp_path, mlp_job, monkeypatch):
    exported = _small_export()
    marker = tmp_path / "pwned"
    program = _program(exported)
    program.model_program = _poisoned(exported.model, str(marker))
    with pytest.raises(atoll.InvalidInput, match="arbitrary pickled objects are refused"):
        client4._call("SubmitPipeline", program)
    # a worker handed the same archive directly, not by its controller, refuses it unread ...
    worker = client4.status().workers[0]
    channel = grpc.insecure_channel(worker.address)
    load = channel.unary_unary(
        "/atoll.v1.Worker/LoadPlan",
        request_serializer=pb.LoadPlanRequest.SerializeToString,
        response_deserializer=pb.LoadPlanReply.FromString,
    )
    request = pb.LoadPlanRequest(
        job_id="evil",
        mesh=Mesh.of(pipeline=1).place(0).to_pb(),
        stages=[pb.StageProgram(stage=0, exported_program=program.model_program)],
    )
    with pytest.raises(grpc.RpcError) as err:
        load(request, metadata=call_metadata(cluster4.token), timeout=30)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "only the controller this worker registered with" in err.value.details()
    channel.close()
    # ... and the loader a worker runs on its controller's plans refuses it as the controller did
    monkeypatch.setenv(FORCE_WEIGHTS_ONLY_ENV, "1")
    with pytest.raises(atoll.InvalidInput, match="arbitrary pickled objects are refused"):
        deserialize(program.model_program, "stage 0 program")
    assert not marker.exists()
    still_serving(*mlp_job)
