"""Optimizers by name with plain arguments: what travels is ``("adamw", {"lr": 1e-3})``, never code."""

from __future__ import annotations

import inspect
import numbers

import torch
from torch.optim import optimizer as torch_optimizer

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


def step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` without the wrapper torch puts around every optimizer class's step (a
    profiler range and the step hooks), where no hook is registered, as none is on a worker's
    optimizer: on a small stage the wrapper costs as much as the update (one thread, 2 tensors of
    8 x 8, multi-tensor: SGD 29-30 against 57-67 us a step, AdamW 217-232 against 256-280). A torch
    without that wrapper, or a hook registered: the plain call."""
    raw = getattr(type(optimizer).step, "__wrapped__", None)
    hooked = optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
    if raw is None or hooked or any(map(bool, _GLOBAL_HOOKS)):
        optimizer.step()
    else:
        raw(optimizer)


# torch's tables of hooks registered for every optimizer, looked up once: registering fills them in
# place. A torch without them counts as hooked (a truthy stand-in), so the plain call is made.
_GLOBAL_HOOKS = tuple(getattr(torch_optimizer, f"_global_optimizer_{when}_hooks", True) for when in ("pre", "post"))
