"""Small models the multi-process tests train, with blocks of deliberately unequal cost."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atoll.core.dataflow import BATCH, Dataflow, Edge, Routes
from atoll.core.wire import EdgeSpec, TensorSpec
from examples.gpt import CharCorpus, GPTConfig, build_gpt, lm_loss  # noqa: F401 (lm_loss: for tests)


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


class _Block(nn.Module):
    """Pre-norm residual MLP block; ``batch_norm`` adds running statistics (buffers trained)."""

    def __init__(self, width: int, batch_norm: bool = False):
        super().__init__()
        self.norm = nn.BatchNorm1d(width) if batch_norm else nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, h):
        return h + self.ff(self.norm(h))


class SkipNet(nn.Module):
    """Nested submodules whose forward is not its children run in order: the stem's output is
    added again after the last block, so with 3+ stages it crosses two stage boundaries."""

    def __init__(self, width: int = 32, depth: int = 4):
        super().__init__()
        self.stem = nn.Linear(16, width)
        self.blocks = nn.ModuleList(_Block(width, batch_norm=(i == 1)) for i in range(depth))
        self.out = nn.Linear(width, 4)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        skip = h
        for block in self.blocks:
            h = block(h)
        return self.out(h + skip)


def skip_net(seed: int = 0, width: int = 32) -> tuple[nn.Module, list, callable]:
    torch.manual_seed(seed)
    model = SkipNet(width)
    g = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)) for _ in range(4)]
    return model, batches, F.mse_loss


class TiedLM(nn.Module):
    """Token embedding shared with the output head (as GPT-2's wte and lm_head)."""

    def __init__(self, vocab: int = 24, width: int = 32, depth: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*[_Block(width) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        return self.head(self.norm(self.blocks(self.embed(idx))))


def tied_lm(seed: int = 0, width: int = 32) -> tuple[nn.Module, list, callable]:
    torch.manual_seed(seed)
    model = TiedLM(width=width)
    g = torch.Generator().manual_seed(seed + 1)
    batches = [
        (torch.randint(0, 24, (8, 12), generator=g), torch.randint(0, 24, (8, 12), generator=g)) for _ in range(4)
    ]
    return model, batches, lm_loss


class LogitsOnly(nn.Module):
    """A Hugging Face causal LM returning its logits alone (its output object is not a tensor)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids, use_cache=False).logits


def placed_chain(stage_ranks: list[int]) -> Routes:
    """A chain of stages on these ranks (stage s feeds stage s + 1), each edge one float tensor,
    for pure-logic tests."""
    x = EdgeSpec("x", (TensorSpec((1,), "float32"),))
    edges = [Edge(BATCH, 0, (0,), (0,), x)] + [Edge(s, s + 1, (0,), (0,), x) for s in range(len(stage_ranks) - 1)]
    return Routes(Dataflow(len(stage_ranks), tuple(edges)), stage_ranks)


def chain_routes(topo) -> Routes:
    return placed_chain(topo.stage_ranks)


def submit(client, make=mlp, seed: int = 0, **pipeline_args):
    """Build a test model and submit it as a pipeline; returns (job, model, batches, loss_fn)."""
    model, batches, loss_fn = make(seed)
    x, y = batches[0]
    job = client.pipeline(model, example_input=x, example_target=y, loss_fn=loss_fn, **pipeline_args)
    return job, model, batches, loss_fn


def in_float64(make):
    """``make()``'s model, batches and loss in float64 (token ids stay integers): parity tests
    compare weights under AdamW in float64, so that a mismatch is not rounding."""
    model, batches, loss_fn = make()
    as64 = lambda t: t.double() if t.is_floating_point() else t  # noqa: E731
    return model.double(), [(as64(x), as64(y)) for x, y in batches], loss_fn


def hf_gpt2(transformers, batch: int = 8):
    """GPT-2 from transformers, tiny and randomly initialized (no dropout), returning logits only;
    and three batches of ``batch`` x 16 tokens."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    model = LogitsOnly(transformers.GPT2LMHeadModel(config))
    g = torch.Generator().manual_seed(1)
    tokens = lambda: torch.randint(0, 64, (batch, 16), generator=g)  # noqa: E731
    return model, [(tokens(), tokens()) for _ in range(3)]


class _FusedGateUp(nn.Module):
    """A SwiGLU MLP whose gate and up projections are one linear layer, chunked (as Phi-3 writes it)."""

    def __init__(self):
        super().__init__()
        self.inp, self.gate_up_proj, self.down_proj = nn.Embedding(32, 32), nn.Linear(32, 128), nn.Linear(64, 32)
        self.out = nn.Linear(32, 32)

    def forward(self, idx):
        h = self.inp(idx)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return self.out(h + self.down_proj(F.silu(gate) * up))


def fused_gate_up(seed: int = 0) -> tuple[nn.Module, list, callable]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    batches = [
        (torch.randint(0, 32, (8, 16), generator=g), torch.randint(0, 32, (8, 16), generator=g)) for _ in range(3)
    ]
    return _FusedGateUp(), batches, lm_loss


def hf_llama(transformers, family: str = "llama", batch: int = 8):
    """A tiny, randomly initialized Llama-family causal LM from transformers, returning logits only:
    4 attention heads over 2 key/value heads (grouped-query), rotary positions, SwiGLU, RMSNorm.
    ``family``: "llama", "llama-bias" (q/k/v/o biases, as Qwen2 has on q/k/v) or "mistral"; and
    three batches of ``batch`` x 16 tokens."""
    torch.manual_seed(0)
    shape = dict(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    if family == "mistral":
        lm = transformers.MistralForCausalLM(transformers.MistralConfig(**shape))
    else:
        lm = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, attention_bias=family == "llama-bias"))
    g = torch.Generator().manual_seed(1)
    tokens = lambda: torch.randint(0, 64, (batch, 16), generator=g)  # noqa: E731
    return LogitsOnly(lm), [(tokens(), tokens()) for _ in range(3)]


LLAMA_PROJECTIONS = {
    **dict.fromkeys(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), "colwise"),
    **dict.fromkeys(("o_proj", "down_proj"), "rowwise"),
}


def tp_roles(plan_report) -> dict[str, str]:
    """Module -> its tensor-parallel role (or why it stays whole), over every stage of a plan."""
    return {m: role for s in plan_report["stages"] for m, role in s["tensor_parallel"]["modules"].items()}


def assert_llama_projections_sharded(roles: dict[str, str], layers: int = 2) -> None:
    """Every projection of ``hf_llama``'s layers cut, its embedding and head by vocabulary."""
    for layer in range(layers):
        for name, role in LLAMA_PROJECTIONS.items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            assert roles[f"lm.model.layers.{layer}.{part}.{name}"] == role, (layer, name, roles)
    assert roles["lm.model.embed_tokens"] == "vocab_embedding" and roles["lm.lm_head"] == "vocab_head"


def compile_locally(model: nn.Module, x, y, loss_fn, **config):
    """``model`` exported as a client would and compiled in this process (no cluster): the
    controller's CompiledPipeline, for ``JobConfig(**config)``."""
    from atoll.client.export import export_pipeline
    from atoll.controller.compiler.pipeline import PipelineRequest, compile_pipeline
    from atoll.core.config import JobConfig

    job = JobConfig(**config)
    ported = export_pipeline(model, x, y, loss_fn, job.microbatches * job.data_parallel)
    return compile_pipeline(
        PipelineRequest(
            model=ported.model,
            aliases=ported.aliases,
            loss=ported.loss,
            input=ported.input,
            target=ported.target,
            config=job,
        )
    )
