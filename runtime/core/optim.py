"""Optimizers by name with plain arguments: what travels is ``("adamw", {"lr": 1e-3})``, never code."""

from __future__ import annotations

import inspect
import numbers

import torch

from atoll.errors import InvalidInput

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}


def _plain(value) -> bool:
    if isinstance(value, (bool, numbers.Real)) or value is None:
        return True
    return isinstance(value, (list, tuple)) and all(isinstance(v, numbers.Real) for v in value)


def validate_optimizer(name: str, args: dict) -> None:
    if name not in OPTIMIZERS:
        raise InvalidInput(f"unknown optimizer {name!r} (known: {sorted(OPTIMIZERS)})")
    if not isinstance(args, dict):
        raise InvalidInput(f"optimizer_args must be a dict, got {type(args).__name__}")
    accepted = set(inspect.signature(OPTIMIZERS[name]).parameters) - {"params"}
    for key, value in args.items():
        if key not in accepted:
            raise InvalidInput(f"optimizer {name!r} takes no argument {key!r} (it takes {sorted(accepted)})")
        if not _plain(value):
            raise InvalidInput(f"optimizer argument {key!r} must be a number, bool or list of numbers")


def build_optimizer(name: str, params, args: dict) -> torch.optim.Optimizer:
    validate_optimizer(name, args)
    args = {k: tuple(v) if isinstance(v, list) else v for k, v in args.items()}
    # torch steps CPU parameters one at a time unless told otherwise (on CUDA it already batches):
    # the multi-tensor form computes the same update in far fewer calls (AdamW over the GPT
    # example's 72 tensors: 3.2 -> 1.7 ms a step on a 2-core machine). An explicit choice wins,
    # and a fused step (which torch refuses next to foreach) is one.
    if not args.get("fused"):
        args.setdefault("foreach", True)
    return OPTIMIZERS[name](list(params), **args)
