"""LoRA adapters (Hu et al.): y = W0 x + (alpha / r) B A x, only A and B trained.

``with_adapters`` copies a model with its target linear layers wrapped (``LoraLinear``) and every
other parameter frozen; the wrapped layer keeps the base's parameter names (``q_proj.weight``), so
a job attached to a resident base finds the base's tensors under them on its workers
(runtime/worker/loader.py), and adds ``q_proj.lora_A.weight`` and ``q_proj.lora_B.weight``.
Adapters are saved in Hugging Face PEFT's layout: ``adapter_model.safetensors`` with the keys
``base_model.model.<module>.lora_A.weight``, and ``adapter_config.json``, which
``peft.PeftModel.from_pretrained`` loads onto the base model.
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from atoll.client.job import Job
from atoll.errors import InvalidInput

PEFT_PREFIX = "base_model.model."
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    """Module names or their last parts (``"q_proj"`` matches ``layers.0.attn.q_proj``), as PEFT's
    ``target_modules``."""

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_peft(self) -> dict:
        """``adapter_config.json`` as PEFT writes it for a plain LoRA (the keys it needs; it fills
        the rest with its defaults)."""
        return {
            "peft_type": "LORA",
            "task_type": None,
            "base_model_name_or_path": None,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": sorted(self.targets),
            "lora_dropout": 0.0,
            "fan_in_fan_out": False,
            "bias": "none",
            "use_rslora": False,
            "use_dora": False,
            "init_lora_weights": True,
            "modules_to_save": None,
            "inference_mode": True,
        }

    @staticmethod
    def from_peft(config: dict) -> LoraConfig:
        if config.get("peft_type") != "LORA":
            raise InvalidInput(f"not a LoRA adapter config (peft_type {config.get('peft_type')!r})")
        refused = [k for k in ("use_rslora", "use_dora", "fan_in_fan_out", "modules_to_save") if config.get(k)]
        if refused or config.get("bias", "none") != "none":
            raise InvalidInput(f"adapter config uses what atoll's LoRA does not build: {refused or ['bias']}")
        targets = config["target_modules"]
        return LoraConfig(
            rank=int(config["r"]),
            alpha=float(config["lora_alpha"]),
            targets=(targets,) if isinstance(targets, str) else tuple(targets),
        )


class LoraLinear(nn.Module):
    """A frozen ``nn.Linear`` (its ``weight`` and ``bias`` under their own names) plus a trained
    low-rank update, computed in PEFT's order: base(x) + lora_B(lora_A(x)) * scaling."""

    def __init__(self, base: nn.Linear, rank: int, scaling: float):
        super().__init__()
        self.weight = base.weight
        self.bias = base.bias
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, dtype=base.weight.dtype)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, dtype=base.weight.dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # as PEFT initializes them
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(x)) * self.scaling


def _targeted(name: str, targets: tuple[str, ...]) -> bool:
    return any(name == t or name.endswith(f".{t}") for t in targets)


def with_adapters(model: nn.Module, config: LoraConfig, init: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """A copy of ``model`` with every target ``nn.Linear`` wrapped in a ``LoraLinear`` and every
    other parameter frozen (``model`` itself is left as it is). ``init``: the adapter's starting
    tensors (``adapter_state`` names, or PEFT's keys), else PEFT's initialization."""
    if config.rank < 1:
        raise InvalidInput(f"LoRA rank must be at least 1, got {config.rank}")
    found = [n for n, m in model.named_modules() if n and _targeted(n, config.targets)]
    if not found:
        raise InvalidInput(f"no module of the model matches the LoRA targets {list(config.targets)}")
    wrong = [f"{n} ({type(m).__name__})" for n, m in model.named_modules() if n in found and type(m) is not nn.Linear]
    if wrong:
        raise InvalidInput(f"LoRA targets must be nn.Linear layers; these are not: {', '.join(wrong)}")
    adapted = copy.deepcopy(model)
    for p in adapted.parameters():
        p.requires_grad_(False)
    for name in found:
        owner, _, attr = name.rpartition(".")
        parent = adapted.get_submodule(owner)
        setattr(parent, attr, LoraLinear(getattr(parent, attr), config.rank, config.scaling))
    if init is not None:
        load_adapter_state(adapted, init)
    return adapted


def adapter_tp_plan(model: nn.Module) -> dict[str, str]:
    """Under tensor parallelism, each adapter's A is cut row-parallel where the base layer is (its
    input arrives sharded) and kept whole where the base layer is column-parallel; B then follows
    the base layer's cut (column-parallel) or stays whole (after A's all-reduce)."""
    return {f"{name}.lora_A": "rowwise_if_sharded" for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trained tensors of a model made by ``with_adapters``, by parameter name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Set a model's adapter tensors from ``state`` (atoll's names or PEFT's keys); every adapter
    tensor must be given, at its shape."""
    state = {k.removeprefix(PEFT_PREFIX): v for k, v in state.items()}
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if state.keys() != params.keys():
        missing, extra = sorted(params.keys() - state.keys()), sorted(state.keys() - params.keys())
        raise InvalidInput(f"adapter state does not fit: missing {missing[:5]}, unknown {extra[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            if state[name].shape != p.shape:
                raise InvalidInput(f"adapter tensor {name} has shape {list(state[name].shape)}, not {list(p.shape)}")
            p.copy_(state[name])


def save_adapter(path: str | os.PathLike, state: dict[str, torch.Tensor], config: LoraConfig) -> Path:
    """Write ``state`` (``adapter_state`` names) and ``config`` into the directory ``path`` in
    PEFT's layout."""
    from safetensors.torch import save_file

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {PEFT_PREFIX + name: t.detach().contiguous().cpu() for name, t in state.items()}
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(config.to_peft(), indent=2))
    return directory


def load_adapter(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], LoraConfig]:
    """An adapter saved in PEFT's layout: its tensors (``adapter_state`` names) and config."""
    from safetensors.torch import load_file

    directory = Path(path)
    config = LoraConfig.from_peft(json.loads((directory / CONFIG_FILE).read_text()))
    state = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(str(directory / WEIGHTS_FILE)).items()}
    return state, config


def merge(base_state: dict[str, torch.Tensor], state: dict[str, torch.Tensor], config: LoraConfig) -> dict:
    """The base's state dict with each adapted weight replaced by W0 + (alpha / r) B A: a plain
    model for export, without adapters."""
    merged = dict(base_state)
    for name in state:
        if not name.endswith(".lora_A.weight"):
            continue
        module = name.removesuffix(".lora_A.weight")
        a, b = state[name], state[f"{module}.lora_B.weight"]
        w0 = base_state[f"{module}.weight"]
        merged[f"{module}.weight"] = w0 + (b.to(w0.dtype) @ a.to(w0.dtype)) * config.scaling
    return merged


class AdapterJob(Job):
    """A job training LoRA adapters on a resident base (``Client.lora``): its state is its adapters."""

    def __init__(self, client, job_id: str, plan, config: LoraConfig):
        super().__init__(client, job_id, plan)
        self.lora = config

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors after every step sent so far (``lora_A``/``lora_B`` by module)."""
        return {k: v for k, v in self.state_dict().items() if ".lora_A." in k or ".lora_B." in k}

    def save_adapter(self, path: str | os.PathLike) -> Path:
        """Write the adapter in PEFT's layout (``peft.PeftModel.from_pretrained(base, path)`` loads it)."""
        return save_adapter(path, self.adapter_state_dict(), self.lora)

    def merged_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """``model``'s (the base's) state dict with the adapter merged in: W0 + (alpha / r) B A."""
        return merge(model.state_dict(), self.adapter_state_dict(), self.lora)
