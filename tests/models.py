"""Small models the multi-process tests train, with blocks of deliberately unequal cost."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from examples.gpt import CharCorpus, GPTConfig, build_gpt, lm_loss


def mlp(seed: int = 0) -> tuple[nn.Module, list, callable]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(16, 64),
        nn.ReLU(),
        nn.Linear(64, 128),
        nn.Tanh(),
        nn.Linear(128, 32),
        nn.ReLU(),
        nn.Linear(32, 64),
        nn.GELU(),
        nn.Linear(64, 4),
    )
    g = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)) for _ in range(5)]
    return model, batches, F.mse_loss


def transformer(seed: int = 0, layers: int = 4) -> tuple[nn.Module, list, callable]:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=24, block_size=16, d_model=32, n_heads=4, n_layers=layers)
    model = build_gpt(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    batches = [
        (torch.randint(0, 24, (16, 16), generator=g), torch.randint(0, 24, (16, 16), generator=g)) for _ in range(5)
    ]
    return model, batches, lm_loss


def char_gpt(
    *, layers: int = 6, d_model: int = 64, steps: int = 3, dtype=torch.float32, seed: int = 0, batch_seed: int = 0
) -> tuple[nn.Module, list]:
    """The GPT example on its own corpus: the model and ``steps`` batches of 32 x 64 tokens."""
    torch.manual_seed(seed)
    corpus = CharCorpus()
    model = build_gpt(GPTConfig(vocab_size=corpus.vocab_size, n_layers=layers, d_model=d_model)).to(dtype)
    g = torch.Generator().manual_seed(batch_seed)
    return model, [corpus.batch(32, 64, g) for _ in range(steps)]


def submit(client, make=mlp, seed: int = 0, **pipeline_args):
    """Build a test model and submit it as a pipeline; returns (job, model, batches, loss_fn)."""
    model, batches, loss_fn = make(seed)
    x, y = batches[0]
    job = client.pipeline(model, example_input=x, example_target=y, loss_fn=loss_fn, **pipeline_args)
    return job, model, batches, loss_fn
