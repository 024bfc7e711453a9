"""The compiler's fake kernels agree with the real ones where the memory plan reads them
(controller/compiler/fake_kernels.py): torch 2.11's CPU flash attention made its logsumexp float32
for a float64 query, which autograd saves for the backward."""

import pytest
import torch

from atoll.controller.compiler import fake_kernels
from atoll.controller.compiler.program import fake_mode


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_cpu_flash_attentions_fake_outputs_are_the_real_ones(dtype):
    fake_kernels.mend()
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    query = torch.randn(2, 3, 5, 4).to(dtype)
    real = op(query, query, query, 0.0, True)
    with fake_mode() as mode:
        fake_query = mode.from_tensor(query)
        fake = op(fake_query, fake_query, fake_query, 0.0, True)
    for r, f in zip(real, fake):
        assert (f.dtype, f.shape, f.stride()) == (r.dtype, r.shape, r.stride())
        assert f.untyped_storage().nbytes() == r.untyped_storage().nbytes()  # what the plan counts
