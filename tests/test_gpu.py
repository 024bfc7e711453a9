"""The GPU data plane on a real CUDA device: workers sharing one GPU talk over CUDA IPC, and
training matches a single-process CUDA run of the same model. Skipped without CUDA.

Tolerance: 1e-4 relative for fp32 (the brief's bar for GPU runs). The pipeline and the reference
run the same CUDA kernels, but per-microbatch backward and cross-process gradient sums change
the order of floating-point accumulation, and the GPU's reductions are not order-fixed.
"""

import copy
import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import atoll
from atoll.client import cuda_mps
from examples.gpt import lm_loss
from tests import models
from tests.reference import assert_matches_reference, relative_error, train_reference
from tests.test_zero import _check_plan

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

RANKS, MICROBATCHES = 4, 8
GPU_RTOL = 1e-4
ROOT = Path(__file__).resolve().parent.parent
ADAMW = {"lr": 1e-3, "weight_decay": 0.01}


@pytest.fixture(scope="module")
def gpu_cluster():
    """Four workers on one GPU (NCCL cannot pair ranks there; CUDA IPC can), as LocalCluster
    starts them by default: under a CUDA MPS daemon of its own where the driver ships one."""
    with atoll.LocalCluster(workers=RANKS, devices=["cuda:0"] * RANKS, threads_per_worker=1) as cluster:
        assert cluster.mps_running == cuda_mps.wanted(None, cluster.devices)
        yield cluster


@pytest.fixture()
def gpu_client(gpu_cluster):
    with gpu_cluster.client() as client:
        yield client


def gpt(layers: int = 6, steps: int = 5, dtype=torch.float32):
    return models.char_gpt(layers=layers, d_model=128, steps=steps, dtype=dtype, batch_seed=1)


def submit_gpt(client, model, batches, stages: int = RANKS, microbatches: int = MICROBATCHES, **kwargs):
    x, y = batches[0]
    return client.pipeline(
        model,
        example_input=x,
        example_target=y,
        loss_fn=lm_loss,
        stages=stages,
        microbatches=microbatches,
        device="cuda",
        **kwargs,
    )


def train_atoll(client, model, batches, **kwargs):
    job = submit_gpt(client, model, batches, **kwargs)
    try:
        losses = [job.step(x, y) for x, y in batches]
        return job.plan, losses, job.state_dict(), job.last.memory
    finally:
        job.close()


def reference_cuda(model, batches, optimizer: str, args: dict, microbatches: int = MICROBATCHES, loss_fn=lm_loss):
    cuda_batches = [(x.cuda(), y.cuda()) for x, y in batches]
    losses, state = train_reference(copy.deepcopy(model).cuda(), cuda_batches, loss_fn, microbatches, optimizer, args)
    return losses, {k: v.cpu() for k, v in state.items()}


def _bench(script: str, *args: str) -> str:
    """What ``bench/SCRIPT ARGS`` prints, run in a process of its own (its peers and
    multiprocessing's helpers end with it)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def report(name: str, **values) -> None:
    """One line per figure the closing note quotes: printed (pytest -s) and, where
    $ATOLL_GPU_REPORT names a file, appended to it (pytest-xdist's workers print nowhere)."""
    line = f"GPU-REPORT {name} {json.dumps(values)}"
    print(f"\n{line}")
    if os.environ.get("ATOLL_GPU_REPORT"):
        with open(os.environ["ATOLL_GPU_REPORT"], "a") as f:
            f.write(line + "\n")


def assert_predicted_memory(plan, memory, name: str, against_allocator: bool = False) -> None:
    """Each rank's predicted peak within 10% of the workers' own accounting (reported as ``name``);
    with ``against_allocator``, next to CUDA's allocator peak too."""
    for rank in range(RANKS):
        predicted, counted = plan.predicted_memory[rank]["total"], memory[rank]["peak"]["total"]
        allocator = {"cuda_max_allocated": memory[rank]["cuda_max_allocated"]} if against_allocator else {}
        report(name, rank=rank, predicted=predicted, counted=counted, **allocator)
        assert abs(predicted - counted) <= 0.10 * counted, f"rank {rank}: predicted {predicted}, counted {counted}"
        if against_allocator:  # the allocator also holds temporaries the plan does not stash: it sees more
            peak = allocator["cuda_max_allocated"]
            assert peak >= 0.95 * counted, f"rank {rank}: allocator peak {peak} < counted {counted}"


def test_four_workers_on_one_gpu_1f1b_over_cuda_ipc_match_single_process_cuda(gpu_client):
    model, batches = gpt()
    plan, losses, state, memory = train_atoll(
        gpu_client, model, batches, schedule="1f1b", optimizer="adamw", optimizer_args=ADAMW
    )
    assert [e["transport"] for e in plan.report["edges"]] == ["cuda_ipc"] * (RANKS - 1)
    assert plan.report["device"] == "cuda" and plan.report["analysis_device"] == "cuda"
    ref_losses, ref_state = reference_cuda(model, batches, "adamw", ADAMW)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    report("parity_fp32", losses=losses, reference=ref_losses, worst_loss_rel_error=worst)
    assert_matches_reference(losses, state, ref_losses, ref_state, rtol=GPU_RTOL)
    assert losses[-1] < losses[0]

    assert_predicted_memory(plan, memory, "memory", against_allocator=True)


@pytest.mark.parametrize("schedule", ["zb_h1", "zbv"])
def test_zero_bubble_schedules_on_one_gpu_match_single_process_cuda(gpu_client, schedule):
    """Backwards split into I and W (issue 27) on CUDA workers: ZB-H1 on 4 stages, ZBV on 8 (two
    chunks per worker in a V, its turn a local hand-off), against one CUDA process."""
    model, batches = gpt(layers=4, steps=3)
    chunks = 1 if schedule == "zb_h1" else 2
    plan, losses, state, memory = train_atoll(
        gpu_client, model, batches, schedule=schedule, virtual_stages=chunks, optimizer="adamw", optimizer_args=ADAMW
    )
    assert "0I0" in plan.actions[0] and "0W0" in plan.actions[0]
    assert {e["transport"] for e in plan.report["edges"]} <= {"cuda_ipc", "local"}
    ref_losses, ref_state = reference_cuda(model, batches, "adamw", ADAMW)
    report(f"parity_{schedule}", losses=losses, reference=ref_losses)
    assert_matches_reference(losses, state, ref_losses, ref_state, rtol=GPU_RTOL)
    assert_predicted_memory(plan, memory, f"memory_{schedule}")


def test_bf16_pipeline_on_one_gpu_trains(gpu_client):
    model, batches = gpt(steps=30, dtype=torch.bfloat16)
    plan, losses, _, _ = train_atoll(
        gpu_client, model, batches, schedule="1f1b", optimizer="adamw", optimizer_args={"lr": 3e-3}
    )
    assert all("bfloat16" in s["output"] for s in plan.report["stages"][:-1])
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    report("bf16", first5=first, last5=last)
    assert last < 0.8 * first, f"bf16 loss did not fall: {first:.3f} -> {last:.3f}"


def test_mixed_precision_on_cuda_workers_matches_the_same_policy_in_one_process(gpu_client):
    """precision="bf16" (issue 29) on CUDA: autocast to bfloat16 in each stage, bfloat16 over
    cuda_ipc between them, against one CUDA process under the same policy (tests/test_mixed_precision.py)."""
    from tests import test_mixed_precision as bf16

    model, batches, _ = models.transformer()
    job, losses, memory = bf16._train(gpu_client, model, batches, "bf16", device="cuda")
    expected = bf16._reference(model, batches, 2, device="cuda")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
    report("bf16_policy", losses=losses, reference=expected, worst_rel_error=worst)
    assert worst <= bf16.BF16_RTOL, (worst, losses, expected)
    assert sum(losses[-5:]) < 0.95 * sum(losses[:5]), losses
    for w, m in memory.items():
        assert m["data_plane_bytes"] == job.plan.predicted_communication[w]
        predicted = job.plan.predicted_memory[w]["total"]
        assert abs(m["peak"]["total"] - predicted) <= 0.10 * predicted, (w, m["peak"], predicted)


def test_gloo_forced_between_gpu_workers_stages_through_pinned_memory(gpu_client):
    """The cross-host fallback for GPU edges without NCCL, run here between workers on one GPU."""
    model, batches = gpt(layers=4, steps=3)
    args = {"lr": 0.05, "momentum": 0.9}
    plan, losses, state, _ = train_atoll(
        gpu_client, model, batches, schedule="gpipe", optimizer="sgd", optimizer_args=args, transport="gloo"
    )
    assert [e["transport"] for e in plan.report["edges"]] == ["gloo"] * (RANKS - 1)
    ref_losses, ref_state = reference_cuda(model, batches, "sgd", args)
    assert_matches_reference(losses, state, ref_losses, ref_state, rtol=GPU_RTOL)


@pytest.mark.parametrize(
    "layout",
    [
        {"stages": 2, "data_parallel": 2, "schedule": "1f1b"},
        {"stages": 1, "data_parallel": 4, "zero": 2},
        {
            "stages": 1, "virtual_stages": 2, "schedule": "interleaved_1f1b", "tensor_parallel": 2,
            "data_parallel": 2, "zero": 3, "reshard_after_forward": True,
        },
    ],
    ids=["pp2xdp2", "zero2-dp4", "zero3-units-tp2xdp2"],
)  # fmt: skip
def test_collectives_between_workers_on_one_gpu_match_single_process_cuda(gpu_client, layout):
    """Data-parallel gradients, ZeRO's reduce-scatters and gathers and a tensor-parallel island's
    collectives between CUDA workers on one GPU (NCCL cannot pair them): through the job's gloo
    group, staged through pinned host memory, against one CUDA process."""
    model, batches, loss_fn = models.transformer()
    replicas, microbatches = layout["data_parallel"], 2
    x, y = batches[0]
    job = gpu_client.pipeline(
        model, example_input=x, example_target=y, loss_fn=loss_fn, microbatches=microbatches, device="cuda",
        optimizer="adamw", optimizer_args=ADAMW, **layout,
    )  # fmt: skip
    try:
        results = [job.step_async(xb, yb).details() for xb, yb in batches]
        state = job.state_dict()
    finally:
        job.close()
    losses = [r.loss for r in results]
    ref_losses, ref_state = reference_cuda(model, batches, "adamw", ADAMW, replicas * microbatches, loss_fn)
    report("collectives", layout=layout, losses=losses, reference=ref_losses)
    assert_matches_reference(losses, state, ref_losses, ref_state, rtol=GPU_RTOL)
    _check_plan(job, results, layout["stages"], replicas, layout.get("tensor_parallel", 1))


@pytest.mark.parametrize("ordering", ["flags", "events"])
def test_cuda_ipc_delivers_every_transfer_whole_and_in_order(ordering):
    """bench/transport.py at its smallest size, as its smoke test: two processes, two buffers, and
    transfers of different bytes, each compared on arrival with what was sent (a copy that ran
    before the receiver freed its buffer, or a read before the copy ended, shows as a wrong one)."""
    args = ["--sizes-mb", "1", "--iters", "20", "--gloo-iters", "2", "--depths", "2", "--orderings", ordering]
    (row,) = json.loads(_bench("transport.py", *args))["results"]
    report("transport_order", row=row)
    assert row["ordering"] == ordering
    assert row["payloads_arrive_whole_and_in_order"], f"transfers {row['wrong_transfers']} arrived wrong"
    assert row["atoll_cuda_ipc_GBps"] > 0
    assert sum(row["cpu_us_per_transfer"]["sender"].values()) > 0, row["cpu_us_per_transfer"]


def test_counters_probe_runs_at_its_smallest_size():
    """bench/counters_probe.py's smoke test: the GPU orders transfers by counters alone."""
    printed = _bench("counters_probe.py", "--sizes-mb", "1", "--depths", "2", "--iters", "50")
    (row,) = [json.loads(line) for line in printed.splitlines() if line.startswith("{")]
    report("counters_probe", row=row)
    assert row["whole"] and row["gbps"] > 0


@pytest.mark.parametrize("ordering", ["flags", "events"])
def test_each_ordering_without_mps_trains_like_single_process_cuda(monkeypatch, ordering):
    """Workers taking turns on the GPU (cuda_mps=False), each cuda_ipc ordering forced in them:
    counters (the choice outside MPS) and events (where the driver lacks stream memory operations)."""
    from atoll.worker.transports.cuda_marks import ORDERING_ENV

    monkeypatch.setenv(ORDERING_ENV, ordering)
    model, batches = gpt(layers=2, steps=3)
    args = {"lr": 0.05, "momentum": 0.9}
    with atoll.LocalCluster(workers=2, devices=["cuda:0"] * 2, threads_per_worker=1, cuda_mps=False) as cluster:
        assert not cluster.mps_running
        with cluster.client() as client:
            _, losses, state, _ = train_atoll(
                client, model, batches, stages=2, microbatches=4, optimizer="sgd", optimizer_args=args
            )
    cuda_batches = [(xb.cuda(), yb.cuda()) for xb, yb in batches]
    ref_losses, ref_state = train_reference(copy.deepcopy(model).cuda(), cuda_batches, lm_loss, 4, "sgd", args)
    assert_matches_reference(losses, state, ref_losses, {k: v.cpu() for k, v in ref_state.items()}, rtol=GPU_RTOL)


def test_nccl_cannot_be_forced_onto_one_gpu(gpu_client):
    model, batches = gpt(layers=4, steps=1)
    with pytest.raises(atoll.InvalidInput, match="'nccl' cannot join two ranks on one GPU"):
        train_atoll(gpu_client, model, batches, transport="nccl")


def test_nccl_transport_in_a_one_rank_group():
    """One GPU allows only a one-rank NCCL group: its collective path runs (P2P needs two GPUs)."""
    from atoll.worker.transports.nccl import NcclTransport

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30))
    nccl = NcclTransport(
        store=torch.distributed.PrefixStore("job/", store),
        rank=0,
        world_size=1,
        timeout_s=30,
    )
    try:
        x = torch.arange(8.0, device="cuda")
        nccl.all_reduce(x).wait(30)
        assert torch.equal(x.cpu(), torch.arange(8.0))
    finally:
        nccl.close()


def test_killed_gpu_worker_fails_the_step_with_a_clear_error():
    with atoll.LocalCluster(workers=2, devices=["cuda:0"] * 2, threads_per_worker=1) as cluster:
        with cluster.client() as client:
            model, batches = gpt(layers=2, steps=2)
            x, y = batches[0]
            job = submit_gpt(client, model, batches, stages=2, microbatches=4, data_plane_timeout_s=20)
            job.step(x, y)
            cluster.kill_worker(1)
            with pytest.raises(atoll.JobFailed):
                job.step(x, y)


def test_evaluate_and_forward_on_cuda_workers_match_the_model(gpu_client):
    model, batches = gpt(layers=4, steps=1)
    x, y = batches[0]
    job = submit_gpt(gpu_client, model, batches, schedule="1f1b")
    try:
        loss, output = job.evaluate(x, y), job.forward(x)
    finally:
        job.close()
    reference = copy.deepcopy(model).cuda()
    with torch.no_grad():
        chunks = zip(x.cuda().chunk(MICROBATCHES), y.cuda().chunk(MICROBATCHES))
        ref_loss = float(sum(lm_loss(reference(xm), ym) for xm, ym in chunks) / MICROBATCHES)
        ref_output = reference(x.cuda()).cpu()
    assert abs(loss - ref_loss) <= GPU_RTOL * abs(ref_loss), f"evaluate {loss} vs {ref_loss}"
    assert relative_error(output, ref_output) <= GPU_RTOL


@pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is None, reason="needs CUDA MPS (nvidia-cuda-mps-control)")
def test_workers_sharing_a_gpu_through_their_own_mps_daemon_match_single_process_cuda():
    model, batches = gpt(layers=2, steps=3)
    args = {"lr": 0.05, "momentum": 0.9}
    with atoll.LocalCluster(workers=2, devices=["cuda:0"] * 2, threads_per_worker=1, cuda_mps=True) as cluster:
        assert cluster.mps_running
        pipe_dir = cluster.log_dir / "mps" / "pipe"
        with cluster.client() as client:
            job = submit_gpt(client, model, batches, stages=2, microbatches=4, optimizer="sgd", optimizer_args=args)
            try:
                losses = [job.step(xb, yb) for xb, yb in batches]
                state = job.state_dict()
                assert [e["transport"] for e in job.plan.report["edges"]] == ["cuda_ipc"]
            finally:
                job.close()
        assert any(pipe_dir.iterdir()), "the cluster's MPS control daemon made no pipe"
    cuda_batches = [(xb.cuda(), yb.cuda()) for xb, yb in batches]
    ref_losses, ref_state = train_reference(copy.deepcopy(model).cuda(), cuda_batches, lm_loss, 4, "sgd", args)
    assert_matches_reference(losses, state, ref_losses, {k: v.cpu() for k, v in ref_state.items()}, rtol=GPU_RTOL)
