"""The GPT example as a model file for ``atoll plan``: prints its pipeline plan without a cluster.

atoll plan examples/gpt_plan.py --schedule interleaved_1f1b --virtual-stages 2
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.gpt import CharCorpus, GPTConfig, build_gpt, lm_loss  # noqa: E402


def build() -> dict:
    torch.manual_seed(0)
    corpus = CharCorpus()
    x, y = corpus.batch(32, 64, torch.Generator().manual_seed(0))
    return dict(
        model=build_gpt(GPTConfig(vocab_size=corpus.vocab_size, n_layers=6)),
        example_input=x,
        example_target=y,
        loss_fn=lm_loss,
        stages=4,
        microbatches=8,
        schedule="1f1b",
        optimizer="adamw",
        optimizer_args={"lr": 1e-3},
    )
