"""What a new user met trying atoll on programs not in the suite, and an operator running the
daemons by hand, each on a live cluster: remote values that outlive the handles their steps were
given, state_dict keys that load back with strict=True, job.last for every mode, mixed tensor and
remote inputs, one step numbering, errors at connect, workers that stop at once on a permanent
error, a readable Job, and the README's conventions."""

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import atoll
from atoll._rpc import atoll_pb2 as pb
from tests.procs import in_process_cluster

pytestmark = pytest.mark.cluster  # every test here starts processes

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _encoder_and_head(client):
    torch.manual_seed(0)
    encoder, head = nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2)
    x, y = torch.randn(8, 8), torch.randn(8, 2)
    a = client.pipeline(encoder, example_input=x, example_target=x, loss_fn=F.mse_loss, stages=1, microbatches=2)
    b = client.pipeline(head, example_input=x, example_target=y, loss_fn=F.mse_loss, stages=1, microbatches=2)
    return a, b, x, y


def test_a_remote_value_given_as_a_temporary_lives_until_its_queued_steps_have_read_it(client4):
    a, b, x, y = _encoder_and_head(client4)
    try:
        futures = [b.step_async(a.forward(x, keep=True), y) for _ in range(4)]  # no handle kept
        assert all(f.result() > 0 for f in futures)
        kept = a.forward(x, keep=True)
        queued = [b.step_async(kept, y) for _ in range(3)]
        kept.free()  # while steps that read it are still on their way: they read it first
        assert all(f.result() > 0 for f in queued)
        again = atoll.RemoteValue(client4, kept.ref)  # a second handle to the freed value
        with pytest.raises(atoll.InvalidInput, match=f"remote value {kept.ref.value_id} was freed"):
            b.step(again, y)
        assert b.step(x, y) > 0 and repr(b).endswith("ready, 1 ranks>")  # refused at submission: the job lives
    finally:
        a.close()
        b.close()


class _Scaled(nn.Module):
    """A block with a non-persistent buffer (as a rotary embedding's inv_freq) and a persistent one."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.register_buffer("inv_freq", torch.linspace(0.5, 1.5, 16), persistent=False)
        self.register_buffer("shift", torch.full((16,), 0.1))

    def forward(self, h):
        return h + self.down(F.gelu(self.up(h * self.inv_freq))) + self.shift


def _scaled_model():
    torch.manual_seed(0)
    return nn.Sequential(_Scaled(), _Scaled(), nn.Linear(16, 4))


@pytest.mark.parametrize(
    "layout", [{"stages": 2}, {"program": True}, {"stages": 1, "tensor_parallel": 2}, {"stages": 1, "data_parallel": 2}]
)
def test_state_dict_has_exactly_the_models_keys_and_loads_strictly(client4, layout, tmp_path):
    model = _scaled_model()
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    if layout.get("program"):
        prog = atoll.Program()
        xi, yi = prog.input("x", x), prog.input("y", y)
        h = prog.stage(model[0], xi, name="first")
        prog.loss(F.mse_loss, prog.stage(nn.Sequential(model[1], model[2]), h, name="rest"), yi)
        job, reference = client4.compile(prog, microbatches=2), prog.module()
    else:
        job = client4.pipeline(model, example_input=x, example_target=y, loss_fn=F.mse_loss, microbatches=2, **layout)
        reference = model
    with job:
        job.step(x, y)
        state = job.state_dict()
        assert set(state) == set(reference.state_dict()) and not any("inv_freq" in k for k in state)
        reference.load_state_dict(state, strict=True)
        if "data_parallel" not in layout and not layout.get("program"):
            saved = job.save(tmp_path / "ckpt")
            with client4.pipeline(
                model, example_input=x, example_target=y, loss_fn=F.mse_loss, microbatches=2, stages=1,
                resume_from=tmp_path / "ckpt",
            ) as resumed:  # fmt: skip
                assert resumed.plan.report["resumed_from"]["step"] == saved["step"]
                resumed_state = resumed.state_dict()
            assert set(resumed_state) == set(model.state_dict())
            assert all(torch.equal(resumed_state[k], state[k]) for k in state)


def test_job_last_is_every_modes_latest_step(client4):
    a, b, x, y = _encoder_and_head(client4)
    try:
        b.step(x, y)
        assert b.last.mode == "train" and b.last.step == 1
        b.evaluate(x, y)
        assert b.last.mode == "evaluate" and b.last.step == 2 and b.last.memory[0]["peak"]["total"] > 0
        b.forward(a.forward(x, keep=True))
        assert b.last.mode == "forward" and b.last.step == 3
        assert b.last.memory[0]["data_plane_bytes"]["received"] >= 8 * 8 * 4  # pulled its remote input
    finally:
        a.close()
        b.close()


def test_a_step_mixes_tensors_and_remote_values(client4):
    torch.manual_seed(0)
    prog = atoll.Program()
    x, z, y = torch.randn(8, 6), torch.randn(8, 4), torch.randn(8, 3)
    xi, zi, yi = prog.input("x", x), prog.input("z", z), prog.input("y", y)
    prog.loss(F.mse_loss, prog.stage(nn.Bilinear(6, 4, 3), xi, zi), yi)
    with client4.compile(prog, microbatches=2) as job:
        plain = job.evaluate((x, z), y)
        remote_z = client4.put(z)
        assert job.evaluate((x, remote_z), y) == plain
        assert job.evaluate((client4.put(x), z), client4.put(y)) == plain
        assert job.last.memory[0]["control_plane_tensor_bytes"] == z.nbytes  # only the tensor travelled with it
        remote_z.free()


def test_a_workers_messages_number_steps_as_the_client_does(tmp_path):
    """RunStepRequest.step is the client's number (1 = the first step), in the worker's errors and
    logs as in traces, status and StepResult.step."""
    with in_process_cluster(tmp_path) as (controller, worker, token_file):
        sent, run = [], worker.service._step
        worker.service._step = lambda request: sent.append(request.step) or run(request)  # what the controller sent
        with atoll.connect(controller.address, token_file=token_file) as client:
            x, y = torch.randn(4, 4), torch.randn(4, 2)
            job = client.pipeline(nn.Linear(4, 2), example_input=x, example_target=y, loss_fn=F.mse_loss,
                                  stages=1, microbatches=1)  # fmt: skip
            job.step(x, y)
            job.step(x, y)
            assert sent == [1, 2] and job.last.step == 2 and job.timeline().summary["steps"] == [2]  # the latest step
            worker.service._step = run
            broken = pb.RunStepRequest(job_id=job.id, step=7, inputs=[pb.TensorData(dtype="float32", shape=[4, 4])])
            with pytest.raises(atoll.JobFailed, match=rf"job {job.id} step 7: "):
                worker.service._step(broken)
            job.close()


def test_connect_checks_the_token_and_the_address_at_once(cluster4):
    with pytest.raises(atoll.Unauthenticated, match="missing or wrong cluster token"):
        atoll.connect(cluster4.address, token="wrong")
    with pytest.raises(atoll.InvalidInput, match="is not HOST:PORT"):
        atoll.connect(cluster4.address.rsplit(":", 1)[0], token=cluster4.token)


def _worker(tmp_path, controller: str, token_file: str, *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "atoll.cli", "worker", "--controller", controller, "--token-file", token_file]
    return subprocess.run([*args, *extra], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_a_worker_with_a_wrong_token_stops_at_once_with_one_line(tmp_path, cluster4):
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    run = _worker(tmp_path, cluster4.address, str(wrong))
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [
        f"atoll worker: the controller at {cluster4.address} refused this worker's token "
        "(--token-file, $ATOLL_TOKEN): missing or wrong cluster token"
    ]


def test_a_worker_without_a_controller_says_so_a_few_times_then_stops(tmp_path):
    """No controller at the address: one warning every few seconds while it retries, then one line."""
    free = socket_free_port()
    token = tmp_path / "token"
    token.write_text("t\n")
    run = _worker(tmp_path, f"127.0.0.1:{free}", str(token), "--register-timeout", "6")
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    warnings = [line for line in lines if "no controller answers at" in line]
    assert 1 <= len(warnings) <= 2, lines  # at 0 s and 5 s, not one per attempt
    assert lines[-1].startswith(f"atoll worker: no controller answered at 127.0.0.1:{free} in 6 s"), lines


def socket_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_job_prints_its_id_name_and_state(client4):
    a, b, *_ = _encoder_and_head(client4)
    named = client4.job(b.id)
    assert repr(a) == f"<atoll.Job {a.id} 'Sequential' ready, 1 ranks>" and named.name == "Linear"
    a.close()
    b.close()
    assert repr(a).endswith("closed, 1 ranks>")


def test_atoll_status_runs_without_torch(cluster4):
    code = (
        "import sys, runpy\n"
        f"sys.argv = ['atoll', 'status', '--controller', {cluster4.address!r}, '--json']\n"
        "try:\n    runpy.run_module('atoll.cli', run_name='__main__')\nexcept SystemExit as e:\n    assert not e.code\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    env = {"PATH": "/usr/bin:/bin", "ATOLL_TOKEN": cluster4.token}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert run.returncode == 0 and '"workers"' in run.stdout, run.stderr


def test_the_readme_documents_program_keys_and_the_plan_file_convention(client4):
    """A program job's state_dict keys are ``stages.<stage name>.<the module's own key>``, as the
    README says, and `atoll plan MODEL_FILE` reads a build() returning pipeline()'s arguments."""
    torch.manual_seed(0)
    prog = atoll.Program()
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    xi, yi = prog.input("x", x), prog.input("y", y)
    prog.loss(F.mse_loss, prog.stage(nn.Linear(4, 2), prog.stage(nn.Linear(4, 4), xi, name="enc"), name="head"), yi)
    with client4.compile(prog, microbatches=2) as job:
        assert set(job.state_dict()) == {
            "stages.enc.weight",
            "stages.enc.bias",
            "stages.head.weight",
            "stages.head.bias",
        }
    assert "stages.<stage name>." in README and "`stages.enc.weight`" in README
    assert re.search(r"atoll plan MODEL_FILE.*\n.*build\(\)", README), "the plan-file convention"
    assert "0600" in README and "--status-grace" in README and "status --all" in README


def test_the_daemons_leave_status_after_the_grace_period(tmp_path):
    """A killed worker and the job it failed leave status after the grace period (a pure test in
    tests/test_operator_checks.py holds that they show within it); status(all=True) still lists them."""
    with atoll.LocalCluster(workers=2, status_grace_s=2.0) as cluster, cluster.client() as client:
        x, y = torch.randn(4, 4), torch.randn(4, 2)
        job = client.pipeline(nn.Linear(4, 2), example_input=x, example_target=y, loss_fn=F.mse_loss,
                              stages=1, microbatches=1)  # fmt: skip
        (holder,) = job.plan.report["placement"].values()
        victim = next(w for w in client.status().workers if w.worker_id == holder.split()[0])
        cluster.kill_worker([p.pid for p in cluster.workers].index(victim.pid))
        with pytest.raises(atoll.JobFailed):
            job.step(x, y)
        deadline = time.monotonic() + 30
        while any(w.worker_id == victim.worker_id for w in client.status().workers):
            assert time.monotonic() < deadline, "the dead worker is still listed long after the grace period"
            time.sleep(0.2)
        assert job.id not in {j.job_id for j in client.status().jobs}
        everything = client.status(all=True)
        assert victim.worker_id in {w.worker_id for w in everything.workers if not w.alive}
        assert job.id in {j.job_id for j in everything.jobs if j.state == "failed"}
        job.close()
