"""The LoRA tests' shared cases: a tiny Llama as the base, adapters of different ranks and targets,
and each adapter's single-process reference built with Hugging Face PEFT (tests/test_lora.py,
tests/lora_tenant.py, bench/lora.py's smoke test)."""

from __future__ import annotations

import copy

import torch

from tests import models

ADAMW = {"lr": 1e-2, "weight_decay": 0.01}
MICROBATCHES = 2

ADAPTERS = (
    dict(rank=4, alpha=8, targets=["q_proj", "v_proj"]),
    dict(rank=2, alpha=2, targets=["o_proj", "down_proj"]),
    dict(rank=8, alpha=16, targets=["k_proj", "gate_proj", "up_proj"]),
    dict(rank=1, alpha=4, targets=["q_proj", "lm_head"]),
)
"""Four tenants' adapters: different ranks, targets on every stage of a 4-stage cut, the head too."""


def base_model(transformers, dtype=torch.float64):
    """The tiny Llama (tests/models.py, ``hf_llama``) and its three batches."""
    model, batches = models.hf_llama(transformers, "llama")
    return model.to(dtype), batches


def peft_model(peft, model, adapter: dict, seed: int):
    """``model`` (copied) with PEFT's LoRA on ``adapter``'s targets, B drawn at random rather than
    zero, so the first step's loss already depends on the adapter."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=adapter["rank"], lora_alpha=adapter["alpha"], target_modules=adapter["targets"], lora_dropout=0.0
    )
    wrapped = peft.get_peft_model(copy.deepcopy(model), config)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    return wrapped


def adapter_of(peft, wrapped) -> dict[str, torch.Tensor]:
    """A PEFT model's adapter tensors, under PEFT's saved keys."""
    return {
        k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(wrapped, save_embedding_layers=False).items()
    }


def train_peft(peft, wrapped, batches) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: per step, the mean microbatch loss, its backward, one AdamW step (as the
    pipeline's steps); the losses and the trained adapter (PEFT's keys)."""
    trained = [p for p in wrapped.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, **ADAMW)
    losses = []
    for x, y in batches:
        pairs = zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))
        loss = sum(models.lm_loss(wrapped(xm), ym) for xm, ym in pairs) / MICROBATCHES
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, adapter_of(peft, wrapped)
