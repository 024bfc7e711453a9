"""Mixed precision (JobConfig.precision "bf16"): what a stage's compute runs under. The worker's
executor and the compiler's memory measurement both use these, so they count the same tensors
(autocast's bfloat16 copies of weights and activations are what a stage saves for its backward)."""

from __future__ import annotations

import contextlib

import torch

from atoll.core.wire import EdgeSpec


def mixed_precision(enabled: bool, device) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to bfloat16 on ``device``'s kind when ``enabled``."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def as_specified(outputs: list[torch.Tensor], spec: EdgeSpec) -> list[torch.Tensor]:
    """A stage's floating outputs in the dtypes its plan gives them (autocast leaves a linear
    layer's output in bfloat16 where the model, unautocast, makes float32)."""
    return [o.to(t.torch_dtype) if o.is_floating_point() else o for o, t in zip(outputs, spec.tensors)]
