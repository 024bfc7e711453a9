"""No size ceiling: a model whose weights exceed the 1 GiB cap of one gRPC message (303M fp32
parameters, 1.2 GB) is submitted, loaded whole on one worker, stepped once and saved. Its weights
cross every hop (client -> controller -> worker) in pieces (atoll.net.chunked), and the worker writes
the checkpoint itself; the saved weights are those of one SGD step in this process."""

import json
from pathlib import Path

import pytest
import safetensors
import torch
import torch.nn.functional as F
from torch import nn

import atoll
from atoll.cli.malloc import DAEMON_MALLOC, daemon_malloc_tunables, has_daemon_malloc
from atoll.net.chunked import available_bytes
from atoll.net.rpc import MAX_MESSAGE_BYTES

pytestmark = pytest.mark.cluster  # every test here starts processes

WIDTH, LAYERS = 8704, 4  # 4 x (8704^2 + 8704) = 303.1M parameters
NEEDED_BYTES = 16 << 30  # the model in this process, the controller and the worker, each with transient copies
LR = 0.1


@pytest.mark.alone  # no other cluster beside it under pytest-xdist (tests/conftest.py)
@pytest.mark.timeout(900)
def test_a_model_larger_than_one_grpc_message_trains_and_saves(tmp_path):
    if available_bytes() < NEEDED_BYTES:
        pytest.skip(f"needs {NEEDED_BYTES >> 30} GiB of free memory, this machine has {available_bytes() >> 30} GiB")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes > MAX_MESSAGE_BYTES
    x, y = torch.randn(2, WIDTH), torch.randn(2, WIDTH)
    with atoll.LocalCluster(workers=1) as cluster, cluster.client() as client:
        for pid in cluster.pids:  # the daemons' malloc settings (DAEMON_MALLOC)
            # ld.so cuts GLIBC_TUNABLES at its colons in place, so each setting shows on its own here
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert b"GLIBC_TUNABLES=" in environ, pid
            assert all(f"{name}=".encode() in environ for name in DAEMON_MALLOC), (pid, environ)
        job = client.pipeline(
            model, example_input=x, example_target=y, loss_fn=F.mse_loss, stages=1, microbatches=1,
            optimizer="sgd", optimizer_args={"lr": LR},
        )  # fmt: skip
        loss = job.step(x, y)
        saved = job.save(tmp_path / "ckpt")
        job.close()

    version = tmp_path / "ckpt" / saved["version"]
    (entry,) = json.loads((version / "manifest.json").read_text())["files"]
    assert saved["step"] == 1 and (version / entry["file"]).stat().st_size > weight_bytes

    expected = F.mse_loss(model(x), y)  # the same step in this process
    expected.backward()
    assert abs(loss - expected.item()) <= 1e-5 * abs(expected.item())
    with torch.no_grad(), safetensors.safe_open(str(version / entry["file"]), framework="pt") as f:
        for name, p in model.named_parameters():
            torch.testing.assert_close(f.get_tensor(f"param/{name}"), p - LR * p.grad, rtol=1e-5, atol=1e-6)


def test_daemons_take_the_malloc_settings_unless_the_caller_chose():
    thresholds = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=134217728"
    both = "glibc.malloc.hugetlb=1:glibc.malloc.arena_max=2:" + thresholds
    assert daemon_malloc_tunables("") == both
    assert daemon_malloc_tunables("glibc.malloc.tcache_count=0") == "glibc.malloc.tcache_count=0:" + both
    assert daemon_malloc_tunables("glibc.malloc.hugetlb=0") == (
        "glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2:" + thresholds
    )
    assert daemon_malloc_tunables("glibc.malloc.arena_max=8:glibc.malloc.hugetlb=2") == (
        "glibc.malloc.arena_max=8:glibc.malloc.hugetlb=2:" + thresholds
    )
    # a daemon started by hand re-executes itself only while a setting is missing (atoll.cli.malloc)
    assert not has_daemon_malloc({}) and not has_daemon_malloc({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
    assert has_daemon_malloc({"GLIBC_TUNABLES": both})
    assert has_daemon_malloc({"GLIBC_TUNABLES": f"glibc.malloc.arena_max=8:glibc.malloc.hugetlb=0:{thresholds}"})
    assert not has_daemon_malloc({"GLIBC_TUNABLES": "glibc.malloc.arena_max=8:glibc.malloc.hugetlb=0"})
