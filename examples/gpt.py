"""A small GPT-style character model, written as an nn.Sequential of blocks so atoll can pipeline it.

Embedding -> N transformer blocks (pre-norm causal self-attention + MLP) -> final norm and head.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

CORPUS = Path(__file__).resolve().parent / "data" / "atoll_tales.txt"


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    vocab_size: int
    """Number of distinct tokens (characters)."""
    block_size: int = 64
    """Context length in tokens."""
    d_model: int = 64
    """Width of the residual stream."""
    n_heads: int = 4
    """Attention heads per block."""
    n_layers: int = 4
    """Transformer blocks."""
    mlp_ratio: int = 4
    """MLP hidden width as a multiple of d_model."""


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.positions = nn.Embedding(cfg.block_size, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tokens(idx) + self.positions(positions)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        # No bias: a key bias shifts every score of a row equally, so its exact gradient is zero and
        # Adam would turn the rounding noise it gets instead into full-size, random updates.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        heads = lambda z: z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)  # noqa: E731
        att = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def build_gpt(cfg: GPTConfig) -> nn.Sequential:
    return nn.Sequential(Embedding(cfg), *[TransformerBlock(cfg) for _ in range(cfg.n_layers)], Head(cfg))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class CharCorpus:
    """Characters of a text file as token ids, with seeded random batches of (input, next-char target)."""

    def __init__(self, path: Path = CORPUS):
        text = path.read_text(encoding="utf-8")
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.index[c] for c in text], dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, batch_size: int, block_size: int, generator: torch.Generator):
        starts = torch.randint(len(self.data) - block_size - 1, (batch_size,), generator=generator)
        x = torch.stack([self.data[s : s + block_size] for s in starts])
        y = torch.stack([self.data[s + 1 : s + block_size + 1] for s in starts])
        return x, y

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


@torch.no_grad()
def sample(
    model: nn.Module, corpus: CharCorpus, prompt: str, length: int, block_size: int, generator: torch.Generator
) -> str:
    ids = [corpus.index[c] for c in prompt if c in corpus.index] or [0]
    for _ in range(length):
        context = torch.tensor([ids[-block_size:]])
        logits = model(context)[0, -1]
        ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)))
    return corpus.decode(ids)
