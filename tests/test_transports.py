"""The transport policy per edge (pure), and what a placed plan records."""

from controller.registry import WorkerRecord
from controller.transports import choose_transport, edge_transports


def worker(device: str, host: str = "a", gpu: str = "") -> WorkerRecord:
    return WorkerRecord(worker_id="w", address="x", device=device, host=host, pid=1, gpu_uuid=gpu, endpoint=None)


def test_transport_follows_placement():
    assert choose_transport(worker("cpu"), worker("cpu", host="b")) == "gloo"
    assert choose_transport(worker("cuda:0", gpu="G0"), worker("cuda:0", gpu="G0")) == "cuda_ipc"
    assert choose_transport(worker("cuda:0", gpu="G0"), worker("cuda:1", gpu="G1")) == "nccl"
    assert choose_transport(worker("cuda:0", gpu="G0"), worker("cuda:0", host="b", gpu="G0")) == "nccl"
    assert choose_transport(worker("cpu"), worker("cuda:0", gpu="G0")) == "gloo"


def test_interleaved_edges_wrap_around_the_ranks():
    edges = edge_transports([0, 1, 0, 1], [worker("cpu"), worker("cpu")])
    assert [(e["from_rank"], e["to_rank"]) for e in edges] == [(0, 1), (1, 0), (0, 1)]
    assert {e["transport"] for e in edges} == {"gloo"}


def test_placed_plan_records_a_transport_per_edge(client4):
    import torch
    import torch.nn.functional as F
    from torch import nn

    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    x = torch.randn(4, 4)
    job = client4.pipeline(model, example_input=x, example_target=x, loss_fn=F.mse_loss, stages=4, microbatches=2)
    try:
        assert [e["transport"] for e in job.plan.report["edges"]] == ["gloo"] * 3
        assert "0->1 rank 0->1 gloo" in job.plan.render()
    finally:
        job.close()
