"""Edges that carry a tuple of tensors (with an integer tensor that has no gradient), and bfloat16."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.reference import assert_matches_reference, train_reference
from tests.test_pipeline_parity import run_pipeline

pytestmark = pytest.mark.cluster  # every test here starts processes


class Fork(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)

    def forward(self, x):
        h = self.lin(x)
        return h, (h > 0).sum(-1)  # (float32 activation, int64 count without a gradient)


class Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, pair):
        h, count = pair
        return torch.tanh(self.lin(h)) * (1 + count.unsqueeze(-1).float() / 16), count


class Join(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 2)

    def forward(self, pair):
        h, count = pair
        return self.lin(h) + count.unsqueeze(-1).float() * 0.01


def test_tuple_edges_match_single_process(client4):
    torch.manual_seed(0)
    model = nn.Sequential(Fork(), Mix(), Mix(), Join())
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)) for _ in range(4)]
    job, losses, state = run_pipeline(
        client4,
        model,
        batches,
        F.mse_loss,
        stages=3,
        microbatches=4,
        schedule="1f1b",
        optimizer="sgd",
        optimizer_args={"lr": 0.1},
    )
    assert job.plan.report["stages"][0]["output"] == "(float32[4, 16], int64[4])"
    ref_losses, ref_state = train_reference(model, batches, F.mse_loss, 4, "sgd", {"lr": 0.1})
    assert_matches_reference(losses, state, ref_losses, ref_state)


def test_bfloat16_end_to_end(client4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)).bfloat16()
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(16, 8, generator=g).bfloat16(), torch.randn(16, 4, generator=g).bfloat16()) for _ in range(4)
    ]
    job, losses, state = run_pipeline(
        client4, model, batches, F.mse_loss, stages=2, microbatches=4, optimizer="sgd", optimizer_args={"lr": 0.05}
    )
    assert "bfloat16" in job.plan.report["stages"][0]["output"]
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    ref_losses, ref_state = train_reference(model, batches, F.mse_loss, 4, "sgd", {"lr": 0.05})
    # bfloat16 keeps 8 bits of mantissa: agreement is to its resolution, not to 1e-5
    assert_matches_reference(losses, state, ref_losses, ref_state, rtol=1e-2)


class Bucketize(nn.Module):
    """Turns features into integer ids: nothing differentiable crosses the next edge."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x):
        return (torch.sigmoid(self.lin(x)).squeeze(-1) * 15).long()


def test_edge_without_a_gradient(client4):
    torch.manual_seed(0)
    model = nn.Sequential(Bucketize(), nn.Embedding(16, 8), nn.Linear(8, 2))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)) for _ in range(3)]
    job, losses, state = run_pipeline(
        client4,
        model,
        batches,
        F.mse_loss,
        stages=2,
        microbatches=4,
        schedule="1f1b",
        split_points=[1],
        optimizer="sgd",
        optimizer_args={"lr": 0.1},
    )
    assert job.plan.report["stages"][0]["output"] == "int64[4]"
    assert not any("RECV_B" in a or "SEND_B" in a for acts in job.plan.actions.values() for a in acts)
    ref_losses, ref_state = train_reference(model, batches, F.mse_loss, 4, "sgd", {"lr": 0.1})
    assert_matches_reference(losses, state, ref_losses, ref_state)
    assert torch.equal(state["0.lin.weight"], model.state_dict()["0.lin.weight"])  # no gradient reached it
