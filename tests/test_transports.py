"""The transport policy per edge (pure), and what a placed plan records."""

import pytest

import atoll
from atoll.controller.cluster.registry import WorkerRecord
from atoll.controller.cluster.transports import (
    choose_transport,
    edge_transports,
    peer_transports,
    replica_transport,
)
from atoll.errors import InvalidInput
from tests.models import placed_chain, submit

pytestmark = pytest.mark.cluster  # every test here starts processes


def worker(device: str, host: str = "a", gpu: str = "") -> WorkerRecord:
    return WorkerRecord(worker_id="w", address="x", device=device, host=host, pid=1, gpu_uuid=gpu, endpoint=None)


def test_transport_follows_placement():
    assert choose_transport(worker("cpu"), worker("cpu")) == "socket"  # a Unix-domain socket on one machine
    assert choose_transport(worker("cpu"), worker("cpu", host="b")) == "socket"  # TCP between machines
    assert choose_transport(worker("cuda:0", gpu="G0"), worker("cuda:0", gpu="G0")) == "cuda_ipc"
    assert choose_transport(worker("cuda:0", gpu="G0"), worker("cuda:1", gpu="G1")) == "nccl"
    assert choose_transport(worker("cuda:0", gpu="G0"), worker("cuda:0", host="b", gpu="G0")) == "nccl"
    assert choose_transport(worker("cpu"), worker("cuda:0", gpu="G0")) == "gloo"


def test_replicas_average_over_a_socket_ring_between_cpu_workers_only():
    cpus, mixed = [worker("cpu")] * 4, [worker("cpu"), worker("cuda:0", gpu="G0")] * 2
    assert replica_transport(cpus, data_parallel=1, zero=0) == ""  # no replicas
    assert replica_transport(cpus, data_parallel=2, zero=0) == "socket"
    assert replica_transport(cpus, data_parallel=2, zero=0, forced="socket") == "socket"
    assert replica_transport(cpus, data_parallel=2, zero=0, forced="gloo") == "gloo"
    assert replica_transport(cpus, data_parallel=2, zero=1) == "gloo"  # ZeRO's reduce-scatter and gathers
    assert replica_transport(mixed, data_parallel=2, zero=0) == "gloo"


def test_interleaved_edges_wrap_around_the_ranks():
    edges = edge_transports(placed_chain([0, 1, 0, 1]), [worker("cpu"), worker("cpu")])
    assert [(e["from_rank"], e["to_rank"]) for e in edges] == [(0, 1), (1, 0), (0, 1)]
    assert {e["transport"] for e in edges} == {"socket"}


def test_placed_plan_records_a_transport_per_edge(client4):
    import torch
    import torch.nn.functional as F
    from torch import nn

    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    x = torch.randn(4, 4)
    job = client4.pipeline(model, example_input=x, example_target=x, loss_fn=F.mse_loss, stages=4, microbatches=2)
    try:
        assert [e["transport"] for e in job.plan.report["edges"]] == ["socket"] * 3
        assert job.plan.report["groups"] == []  # sockets join the ranks of an edge only: no group
        assert "0->1 rank 0->1 socket" in job.plan.render()
        job.step(x, x)
    finally:
        job.close()
    job = client4.pipeline(
        model, example_input=x, example_target=x, loss_fn=F.mse_loss, stages=4, microbatches=2, transport="gloo"
    )
    try:
        assert [e["transport"] for e in job.plan.report["edges"]] == ["gloo"] * 3
        assert job.plan.report["groups"] == ["gloo"]  # every rank joins the job's gloo group
        assert "0->1 rank 0->1 gloo" in job.plan.render()
        job.step(x, x)
    finally:
        job.close()


def test_forced_transport_is_checked_against_placement():
    gpu = worker("cuda:0", gpu="G0")
    assert choose_transport(gpu, worker("cuda:0", gpu="G0"), "gloo") == "gloo"
    assert choose_transport(gpu, worker("cuda:1", gpu="G1"), "nccl") == "nccl"
    with pytest.raises(InvalidInput, match="cannot join two ranks on one GPU"):
        choose_transport(gpu, worker("cuda:0", gpu="G0"), "nccl")
    with pytest.raises(InvalidInput, match="needs both ends on one GPU"):
        choose_transport(gpu, worker("cuda:1", gpu="G1"), "cuda_ipc")
    with pytest.raises(InvalidInput, match="needs CUDA workers at both ends"):
        choose_transport(worker("cpu"), gpu, "nccl")
    assert choose_transport(worker("cpu"), worker("cpu"), "gloo") == "gloo"
    with pytest.raises(InvalidInput, match="'socket' needs CPU workers at both ends"):
        choose_transport(worker("cpu"), gpu, "socket")


def test_peer_table_is_symmetric_and_skips_a_rank_talking_to_itself():
    gpus = [worker("cuda:0", gpu="G0"), worker("cuda:0", gpu="G0"), worker("cuda:1", gpu="G1")]
    edges = edge_transports(placed_chain([0, 1, 2, 2]), gpus)
    table = peer_transports(edges, 3)
    assert table == {0: ["", "cuda_ipc", ""], 1: ["cuda_ipc", "", "nccl"], 2: ["", "nccl", ""]}


def test_cuda_mps_is_refused_for_a_cluster_without_cuda_workers():
    with pytest.raises(ValueError, match="cuda_mps=True needs CUDA workers"):
        atoll.LocalCluster(workers=2, cuda_mps=True)


def test_cuda_mps_by_default_only_where_workers_share_a_gpu(monkeypatch):
    from atoll.client import cuda_mps
    from atoll.client.cuda_mps import shares_a_gpu, wanted

    assert shares_a_gpu(["cuda:0", "cuda"]) and shares_a_gpu(["cpu", "cuda:1", "cuda:1"])
    assert not shares_a_gpu(["cuda:0", "cuda:1"]) and not shares_a_gpu(["cpu", "cpu"])
    assert not wanted(None, ["cuda:0", "cuda:1"]) and not wanted(False, ["cuda:0", "cuda:0"])
    assert wanted(True, ["cuda:0", "cuda:1"])  # asked for: also on distinct GPUs
    assert not atoll.LocalCluster(workers=2).cuda_mps
    # an MPS daemon the workers already reach (the user's, or a system-wide one): no second one
    monkeypatch.setattr(cuda_mps.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(cuda_mps, "DEFAULT_PIPE_DIRECTORY", "/nonexistent/nvidia-mps")
    assert wanted(None, ["cuda:0", "cuda:0"])
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/somewhere")
    assert not wanted(None, ["cuda:0", "cuda:0"]) and wanted(True, ["cuda:0", "cuda:0"])


def test_a_cuda_job_on_cpu_workers_is_refused_clearly(client4):
    with pytest.raises(atoll.NotEnoughWorkers, match="needs 2 workers of device kind 'cuda' .* but 0 are alive"):
        submit(client4, stages=2, microbatches=2, device="cuda")
    with pytest.raises(atoll.InvalidInput, match="transport 'nccl' needs CUDA workers"):
        submit(client4, stages=2, microbatches=2, transport="nccl")
    with pytest.raises(atoll.InvalidInput, match="unknown device kind 'tpu'"):
        submit(client4, stages=2, microbatches=2, device="tpu")
    job, *_ = submit(client4, stages=2, microbatches=2)  # the daemons keep serving
    job.close()
