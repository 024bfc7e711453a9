"""torch's fake kernels where they disagree with its real ones, mended for the compiler's counts.

The memory plan counts what autograd saves by running each stage on fake tensors. torch 2.11's
fake kernel of the CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu``)
makes its logsumexp float32 whatever the query's dtype, where the real kernel makes it float64 for
a float64 query (torch 2.13's fake kernel agrees with the real one). Autograd saves the logsumexp
for the backward, so a float64 attention stage's predicted activations fell short of the worker's
count by its bytes (1-4 KiB a stage of tests/models.py's GPT, every ZeRO-3 plan check failing on
torch 2.11). ``mend`` asks both kernels once and, where they disagree, registers a fake kernel
that agrees; elsewhere it changes nothing.
"""

from __future__ import annotations

import threading

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

_lock = threading.Lock()
_library: torch.library.Library | None = None
"""The mended kernels' registration: it lasts as long as this object (kept for the process)."""
_checked = False


def _flash_attention_for_cpu(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    """Shapes and dtypes as the real kernel gives them: the output like the query, the logsumexp
    (batch, heads, query length) in the query's accumulation dtype (float64 for float64, else
    float32), laid out as the real kernel lays it out."""
    batch, heads, length = query.shape[0], query.shape[1], query.shape[2]
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    logsumexp = torch.empty((batch, length, heads), dtype=dtype, device=query.device).transpose(1, 2)
    return torch.empty_like(query), logsumexp


def _logsumexp_dtypes() -> tuple[torch.dtype, torch.dtype]:
    """The logsumexp's dtype of a float64 query from the real kernel and from the fake one."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    query = torch.zeros(1, 1, 2, 2, dtype=torch.float64)
    real = op(query, query, query, 0.0, False)[1].dtype
    with FakeTensorMode() as mode:
        fake_query = mode.from_tensor(query)
        fake = op(fake_query, fake_query, fake_query, 0.0, False)[1].dtype
    return real, fake


def mend() -> None:
    """Once per process: where the fake kernel disagrees with the real one, register one that agrees."""
    global _checked, _library
    with _lock:
        if _checked:
            return
        _checked = True
        try:
            real, fake = _logsumexp_dtypes()
        except (AttributeError, RuntimeError, NotImplementedError):  # a torch without this kernel
            return
        if real == fake:
            return
        _library = torch.library.Library("aten", "IMPL")
        _library.impl(
            "_scaled_dot_product_flash_attention_for_cpu", _flash_attention_for_cpu, "Meta", allow_override=True
        )
