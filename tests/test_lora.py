"""Multi-tenant LoRA (issue 28): adapter jobs attached to one resident, pipelined base train
exactly like their single-process Hugging Face PEFT references, hold the base once, save adapters
PEFT loads, and one tenant's failure leaves the others' training unchanged."""

from __future__ import annotations

import contextlib
import copy
import io
import subprocess
import sys
import threading
import time

import pytest
import torch

import atoll
from atoll.client import lora
from atoll.client.export import export_pipeline
from atoll.client.local import stop_processes
from tests import lora_cases, models
from tests.reference import assert_losses_match, relative_error

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

RTOL = 1e-5


def _settings(batches):
    x, y = batches[0]
    return dict(example_input=x, example_target=y, loss_fn=models.lm_loss, microbatches=lora_cases.MICROBATCHES)


# ---------------------------------------------------------------------------- in one process


def test_adapters_compute_what_peft_computes():
    model, batches = lora_cases.base_model(transformers)
    for i, adapter in enumerate(lora_cases.ADAPTERS):
        wrapped = lora_cases.peft_model(peft, model, adapter, seed=i)
        config = atoll.LoraConfig(rank=adapter["rank"], alpha=adapter["alpha"], targets=tuple(adapter["targets"]))
        ours = lora.with_adapters(model, config, init=lora_cases.adapter_of(peft, wrapped))
        assert {n for n, p in ours.named_parameters() if p.requires_grad} == {
            k.removeprefix(lora.PEFT_PREFIX) for k in lora_cases.adapter_of(peft, wrapped)
        }
        with torch.no_grad():
            assert torch.equal(ours(batches[0][0]), wrapped(batches[0][0]))
    assert all(p.requires_grad for p in model.parameters())  # the caller's model is left as it was


def test_a_saved_adapter_loads_in_peft_and_merges_as_peft_does(tmp_path):
    model, batches = lora_cases.base_model(transformers)
    adapter = lora_cases.ADAPTERS[0]
    wrapped = lora_cases.peft_model(peft, model, adapter, seed=0)
    config = atoll.LoraConfig(rank=adapter["rank"], alpha=adapter["alpha"], targets=tuple(adapter["targets"]))
    ours = lora.with_adapters(model, config, init=lora_cases.adapter_of(peft, wrapped))
    lora.save_adapter(tmp_path / "a", lora.adapter_state(ours), config)
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "a")
    x = batches[0][0]
    with torch.no_grad():
        assert torch.allclose(loaded(x), ours(x), rtol=1e-12, atol=1e-12)
        state, read_config = lora.load_adapter(tmp_path / "a")
        assert read_config == config and state.keys() == lora.adapter_state(ours).keys()
        merged = copy.deepcopy(model)
        merged.load_state_dict(lora.merge(model.state_dict(), state, config))
        assert torch.allclose(merged(x), wrapped.merge_and_unload()(x), rtol=1e-12, atol=1e-12)


def test_an_attached_job_sends_the_base_as_shapes_only():
    """The workers compute with the resident base's tensors, so a job attached to it sends its
    frozen parameters' shapes, not a copy of the base: of the parameters, the archive holds the
    adapters' bytes only."""
    model, batches = lora_cases.base_model(transformers)
    adapted = lora.with_adapters(model, atoll.LoraConfig(rank=2, alpha=2, targets=("q_proj", "v_proj")))
    x, y = batches[0]
    whole, shapes = (export_pipeline(adapted, x, y, models.lm_loss, 1, keep) for keep in (True, False))
    frozen = sum(p.nbytes for p in adapted.parameters() if not p.requires_grad)
    assert len(whole.model) - len(shapes.model) >= 0.95 * frozen  # the rest is the graph itself
    ep = torch.export.load(io.BytesIO(shapes.model))
    for name, p in adapted.named_parameters():
        kept = ep.state_dict[name]
        assert (kept.shape, kept.dtype, kept.requires_grad) == (p.shape, p.dtype, p.requires_grad)
        assert torch.equal(kept, p) if p.requires_grad else kept.untyped_storage().nbytes() <= 8


def test_adapters_refuse_what_they_cannot_wrap():
    model, _ = lora_cases.base_model(transformers)
    with pytest.raises(atoll.InvalidInput, match="no module of the model matches"):
        lora.with_adapters(model, atoll.LoraConfig(rank=2, alpha=2, targets=("qq_proj",)))
    with pytest.raises(atoll.InvalidInput, match="must be nn.Linear"):
        lora.with_adapters(model, atoll.LoraConfig(rank=2, alpha=2, targets=("input_layernorm",)))
    with pytest.raises(atoll.InvalidInput, match="rank must be at least 1"):
        lora.with_adapters(model, atoll.LoraConfig(rank=0, alpha=2, targets=("q_proj",)))


# ---------------------------------------------------------------------------- on a cluster


@pytest.fixture()
def cluster_client():
    """A 4-worker cluster of the test's own: adapters and bases leave memory behind in a worker
    process (about 130 MB each here), which a cluster shared with the rest of the suite would keep
    while test_large_model needs the machine."""
    with atoll.LocalCluster(workers=4) as cluster, cluster.client() as client:
        yield client


@contextlib.contextmanager
def _base(client, name: str, dtype=torch.float64, **layout):
    """The tiny Llama loaded as the resident base ``name`` (a 4-stage 1F1B pipeline unless
    ``layout`` says otherwise), closed on the way out: (model, batches, base job)."""
    model, batches = lora_cases.base_model(transformers, dtype)
    layout = layout or {"stages": 4}
    base = client.load_base(model, name=name, schedule="1f1b", **layout, **_settings(batches))
    try:
        yield model, batches, base
    finally:
        base.close()


def _attach(client, name, model, batches, adapter, init):
    return client.lora(
        model, base=name, init=init, schedule="1f1b", optimizer_args=lora_cases.ADAMW, **adapter, **_settings(batches)
    )


def _train_side_by_side(jobs, batches) -> list[list[float]]:
    """Every job trains the batches at once, each from its own thread (as separate clients would)."""
    losses: list[list[float]] = [[] for _ in jobs]
    errors = []

    def train(i):
        try:
            losses[i] = [f.result() for f in [jobs[i].step_async(x, y) for x, y in batches]]
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors, errors
    return losses


@pytest.mark.cluster
@pytest.mark.parametrize("name", ["llama32", "llama64"])
def test_four_adapters_on_one_pipelined_base_train_as_peft_does(cluster_client, name):
    """Four adapters (ranks 1-8, targets on every stage) attached to one 4-stage base, trained at
    once: each one's losses match its PEFT reference within 1e-5 (float32 and float64), its weights
    too (float64), and the base's weights are bit-identical before and after."""
    with _base(cluster_client, name, torch.float32 if name == "llama32" else torch.float64) as (model, batches, base):
        _train_four(cluster_client, name, model, batches, base)


def _train_four(client, name, model, batches, base) -> None:
    before = base.state_dict()
    references, jobs = [], []
    for i, adapter in enumerate(lora_cases.ADAPTERS):
        wrapped = lora_cases.peft_model(peft, model, adapter, seed=i)
        init = lora_cases.adapter_of(peft, wrapped)
        references.append(lora_cases.train_peft(peft, wrapped, batches))
        jobs.append(_attach(client, name, model, batches, adapter, init))
    try:
        losses = _train_side_by_side(jobs, batches)
        for job, got, (ref_losses, ref_adapter) in zip(jobs, losses, references):
            assert_losses_match(got, ref_losses, RTOL)
            state = job.adapter_state_dict()
            assert state.keys() == {k.removeprefix(lora.PEFT_PREFIX) for k in ref_adapter}
            if name == "llama64":
                for key, ref in ref_adapter.items():
                    err = relative_error(state[key.removeprefix(lora.PEFT_PREFIX)], ref)
                    assert err <= RTOL, (job.id, key, err)
        after = base.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
        assert all(torch.equal(after[k], v) for k, v in model.state_dict().items())
        _check_memory(model, base, jobs, batches)
        _check_interleaved(jobs)
        shown = client.status().render()
        assert f"resident base {name!r}" in shown and shown.count(f"on base {name!r}") == len(jobs)
    finally:
        for job in jobs:
            job.close()


def _action_times(job, worker: int, last: int = 3) -> dict[int, list[float]]:
    """Step -> when each of the job's actions began on ``worker`` in its ``last`` steps (its
    measured timeline)."""
    trace = job.timeline(last=last)
    times: dict[int, list[float]] = {}
    for e in trace.events["traceEvents"]:
        if e["ph"] == "X" and e["pid"] == 1 and e["tid"] == worker:  # measured rows
            times.setdefault(e["args"]["step"], []).append(trace.summary["origin_s"] + e["ts"] / 1e6)
    return times


def _check_interleaved(jobs) -> None:
    """The attached jobs' steps ran beside each other on the shared workers: on each worker, an
    action of one job began while a step of another was part-way through."""
    for worker in range(4):
        times = [_action_times(job, worker) for job in jobs]
        steps = [(i, min(ts), max(ts)) for i, of_job in enumerate(times) for ts in of_job.values()]
        others = [(i, t) for i, of_job in enumerate(times) for ts in of_job.values() for t in ts]
        assert any(lo < t < hi for i, lo, hi in steps for j, t in others if j != i), f"worker {worker}"


def _check_memory(model, base, jobs, batches) -> None:
    """The base is held once: each attached job's workers count only its adapter's parameters (the
    plan predicts the same, and each worker's whole peak within 10%), where a separate job of the
    same adapted model would hold the base again on every worker."""
    for job in jobs:
        adapter_bytes = sum(t.numel() * t.element_size() for t in job.adapter_state_dict().values())
        measured = job.last.memory
        assert sum(m["peak"]["parameters"] for m in measured.values()) == adapter_bytes
        for w, m in measured.items():
            predicted = job.plan.predicted_memory[w]
            assert m["peak"]["parameters"] == predicted["parameters"], (job.id, w)
            assert abs(m["peak"]["total"] - predicted["total"]) <= 0.1 * predicted["total"], (job.id, w)
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(r["parameters"] for r in base.plan.predicted_memory.values()) == base_bytes
    x, y = batches[0]
    alone = models.compile_locally(
        lora.with_adapters(model, jobs[0].lora), x, y, models.lm_loss, stages=4, microbatches=2, optimizer="adamw"
    )
    held_alone = sum(r.peak.parameters for r in alone.memory.values())
    assert held_alone == base_bytes + sum(r["parameters"] for r in jobs[0].plan.predicted_memory.values())


@pytest.mark.cluster
def test_attached_jobs_share_the_workers_by_weight(cluster_client):
    """Two adapters trained at once, 12 steps each, the one of weight 1 started first: the one of
    weight 3 still finishes first on every worker (tests/test_interleave.py holds the shares)."""
    with _base(cluster_client, "weighted", torch.float32) as (model, batches, _):
        x, y = batches[0]
        jobs = [
            cluster_client.lora(
                model, base="weighted", weight=w, schedule="1f1b", **lora_cases.ADAPTERS[0], **_settings(batches)
            )
            for w in (1.0, 3.0)
        ]
        _train_by_weight(jobs, x, y)


def _train_by_weight(jobs, x, y) -> None:
    try:
        _train_side_by_side(jobs, [(x, y)] * 12)
        for worker in range(4):
            light, heavy = ({s: min(ts) for s, ts in _action_times(job, worker, 12).items()} for job in jobs)
            assert len(heavy) == len(light) == 12
            assert max(heavy.values()) < max(light.values()), worker
    finally:
        for job in jobs:
            job.close()


@pytest.mark.cluster
def test_adapters_follow_a_tensor_parallel_base(cluster_client):
    """A base cut 2 stages x tensor_parallel=2 on the same workers: each adapter is cut as its base
    layer is (B column-parallel under a column-parallel layer, A row-parallel under a row-parallel
    one, the rest whole) and trains as its PEFT reference does, in float64 (losses and weights
    within 1e-5); the base's shards stay bit-identical."""
    client = cluster_client
    with _base(client, "llama-tp", stages=2, tensor_parallel=2) as (model, batches, base):
        before = base.state_dict()
        adapters = [lora_cases.ADAPTERS[1], lora_cases.ADAPTERS[3]]  # row-parallel layers; q_proj and the head
        references, jobs = [], []
        for i, adapter in enumerate(adapters):
            wrapped = lora_cases.peft_model(peft, model, adapter, seed=20 + i)
            init = lora_cases.adapter_of(peft, wrapped)
            references.append(lora_cases.train_peft(peft, wrapped, batches))
            jobs.append(_attach(client, "llama-tp", model, batches, adapter, init))
        try:
            roles = models.tp_roles(jobs[0].plan.report)
            assert roles["lm.model.layers.0.self_attn.o_proj.lora_A"] == "rowwise"
            assert roles["lm.model.layers.0.mlp.down_proj.lora_A"] == "rowwise"
            assert models.tp_roles(jobs[1].plan.report)["lm.model.layers.0.self_attn.q_proj.lora_B"] == "colwise"
            losses = _train_side_by_side(jobs, batches)
            for job, got, (ref_losses, ref_adapter) in zip(jobs, losses, references):
                assert_losses_match(got, ref_losses, RTOL)
                state = job.adapter_state_dict()
                for key, ref in ref_adapter.items():
                    assert relative_error(state[key.removeprefix(lora.PEFT_PREFIX)], ref) <= RTOL, (job.id, key)
        finally:
            for job in jobs:
                job.close()
        after = base.state_dict()
        assert all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.cluster
def test_a_saved_adapter_gives_the_jobs_logits_in_peft(cluster_client, tmp_path):
    with _base(cluster_client, "llama64") as (model, batches, _):
        logits, merged = _train_and_save(cluster_client, model, batches, tmp_path)
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "adapter")
    with torch.no_grad():
        assert relative_error(logits, loaded(batches[0][0])) <= RTOL
        plain = copy.deepcopy(model)
        plain.load_state_dict(merged)
        assert relative_error(plain(batches[0][0]), logits) <= RTOL


def _train_and_save(client, model, batches, tmp_path):
    adapter = lora_cases.ADAPTERS[2]
    wrapped = lora_cases.peft_model(peft, model, adapter, seed=7)
    job = _attach(client, "llama64", model, batches, adapter, lora_cases.adapter_of(peft, wrapped))
    try:
        for x, y in batches:
            job.step(x, y)
        job.save_adapter(tmp_path / "adapter")
        logits = job.forward(batches[0][0])
        merged = job.merged_state_dict(model)
    finally:
        job.close()
    return logits, merged


@pytest.mark.cluster
def test_attaching_refuses_what_does_not_fit(cluster_client):
    with _base(cluster_client, "llama64") as (model, batches, _):
        _refusals(cluster_client, model, batches)


def _refusals(client, model, batches) -> None:
    adapter = lora_cases.ADAPTERS[0]
    with pytest.raises(atoll.NotFound, match="no resident base named 'nope'"):
        _attach(client, "nope", model, batches, adapter, None)
    with pytest.raises(atoll.InvalidInput, match="runs in the base's layout; do not give stages"):
        client.lora(model, base="llama64", stages=2, **adapter, **_settings(batches))
    other = copy.deepcopy(model).float()  # not the base's model: float32 where the base holds float64
    with pytest.raises(atoll.InvalidInput, match="is not the base's"):
        _attach(client, "llama64", other, batches, adapter, None)
    with pytest.raises(atoll.InvalidInput, match="is loaded already"):
        client.load_base(model, name="llama64", stages=4, **_settings(batches))
    # the base goes on serving: a job attached after the refusals trains
    job = _attach(client, "llama64", model, batches, adapter, None)
    try:
        assert job.step(*batches[0]) > 0
    finally:
        job.close()


@pytest.mark.cluster
def test_a_dead_tenant_leaves_the_others_training_unchanged(tmp_path):
    """A second client process trains its adapter on the same base, steps queued, and is killed
    mid-training: this client's adapter still matches its PEFT reference step for step, and the
    dead tenant's job is closed when its lease runs out (3 s here). A third client reads none of it."""
    with (
        atoll.LocalCluster(workers=4, lease_timeout_s=3.0) as cluster,
        cluster.client() as client,
        _base(client, "llama64") as (model, batches, _),
    ):
        _survive_a_dead_tenant(cluster, client, model, batches, tmp_path)


def _survive_a_dead_tenant(cluster, client, model, batches, tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(cluster.token)
    tenant = subprocess.Popen(
        [sys.executable, "-m", "tests.lora_tenant", cluster.address, str(token_file), "llama64"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert tenant.stdout.readline().strip() == "training", "the tenant did not start"
        adapter = lora_cases.ADAPTERS[1]
        wrapped = lora_cases.peft_model(peft, model, adapter, seed=11)
        job = _attach(client, "llama64", model, batches, adapter, lora_cases.adapter_of(peft, wrapped))
        ref_losses, ref_adapter = lora_cases.train_peft(peft, wrapped, batches + batches)
        losses = [job.step(*batches[0])]
        tenant.kill()  # its steps in flight on the shared workers
        tenant.wait(timeout=30)
        losses += [job.step(x, y) for x, y in batches[1:] + batches]
        assert_losses_match(losses, ref_losses, RTOL)
        state = job.adapter_state_dict()
        assert all(relative_error(state[k.removeprefix(lora.PEFT_PREFIX)], v) <= RTOL for k, v in ref_adapter.items())
        with cluster.client() as other:  # another client holding the token reads no tenant's adapters
            with pytest.raises(atoll.NotPermitted, match="only the client that attached it"):
                other.job(job.id).state_dict()
            with pytest.raises(atoll.NotPermitted, match="only the client that attached it"):
                other.job(job.id).save(tmp_path / "stolen")
        deadline = time.monotonic() + 30
        while any(j.name == "tenant" and j.state == "ready" for j in client.status().jobs):
            assert time.monotonic() < deadline, "the dead tenant's job was not closed"
            time.sleep(0.5)
        assert job.step(*batches[0]) > 0
        job.close()
    finally:
        stop_processes([tenant])
